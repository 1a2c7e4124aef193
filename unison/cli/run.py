"""Wiring a validated config into a training run, in named steps: the code behind ``unison run``.

Everything a config can name is checked in the launching process, before any rank is
spawned (:func:`resolve`); each rank then builds the same objects and attaches the same
handlers (:func:`build_run`), one step at a time, into a :class:`RunParts`:

1. data: :func:`build_datasets`, :func:`build_loaders`;
2. model: :func:`build_model`;
3. optimizer and scheduler: :func:`build_optimizer`;
4. trainer: :func:`build_trainer`;
5. evaluator: :func:`build_evaluator`, :func:`attach_validation`, :func:`attach_scheduler`;
6. handlers: :func:`attach_handlers` (early stopping and guards, checkpoint and
   preemption, TensorBoard, progress);
7. resume: :func:`resume_run`;

then training, and the test phase: :func:`finish_run` (test set, predictions, the
recipe's hook, ``metrics.json``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import DataLoader

from unison.config import (
    Config,
    ConfigError,
    PyObjectRef,
    dump_config,
    load_config,
    resolve_ref,
    resolve_tree,
    to_plain,
)
from unison.distributed import (
    barrier,
    broadcast_object,
    detect_launcher,
    get_rank,
    get_world_size,
    launch,
    prepare_loaders,
    prepare_model,
)
from unison.engine import Engine, Events, TrainStep, create_evaluator, create_trainer
from unison.engine.predict import predict
from unison.handlers import (
    Checkpoint,
    EarlyStopping,
    NonFiniteGuard,
    Preemption,
    ProgressBar,
    TimeLimit,
    Watchdog,
)
from unison.metrics import Loss
from unison.utils import get_logger, manual_seed

_log = get_logger(__name__)


@dataclass
class Resolved:
    """The objects a config names, imported and type-checked."""

    optimizer_type: type
    optimizer_kwargs: dict[str, Any]
    scheduler_type: type | None
    scheduler_kwargs: dict[str, Any]
    loss: Callable[..., torch.Tensor]
    model_type: Callable[..., nn.Module]
    model_kwargs: dict[str, Any]
    data_build: Callable[..., Any]
    data_kwargs: dict[str, Any]
    metrics: dict[str, tuple[type, dict[str, Any]]]
    after_training: Callable[[Any], Any] | None


def resolve(config: Config) -> Resolved:
    """Imports every ``!pyobject`` of ``config`` through the allow-list and checks its type.

    Raises:
        ConfigError: for the first reference that is refused, missing or of the wrong kind.
    """
    source = getattr(config, "source", None)
    config_dir = Path(source).parent if source else None
    if config_dir is not None and str(config_dir) not in sys.path:
        sys.path.insert(0, str(config_dir))  # the recipe's own modules; spawned ranks inherit it
    imports = list(config.imports)

    def ref(value: Any, slot: str | None, key: str) -> Any:
        return resolve_ref(value, slot=slot, key=key, imports=imports, config_dir=config_dir)

    def tree(value: Any, key: str) -> Any:
        return resolve_tree(value, key=key, imports=imports, config_dir=config_dir)

    lines: dict[tuple[str, ...], int] = getattr(config, "lines", {})

    def error(key: str, message: str) -> ConfigError:
        return ConfigError(message, file=source, line=lines.get(tuple(key.split("."))), key=key.split("."))

    t = config.training
    metrics: dict[str, tuple[type, dict[str, Any]]] = {}
    for name, spec in config.validation.metrics.items():
        key = f"validation.metrics.{name}"
        if not isinstance(spec, (dict, PyObjectRef)):
            raise error(
                key,
                f"a metric is `!pyobject Class` or {{type: !pyobject Class, kwargs: {{...}}}}, got {spec!r}",
            )
        if isinstance(spec, dict):
            unknown = set(spec) - {"type", "kwargs"}
            if "type" not in spec or unknown:
                raise error(
                    key,
                    f"a metric is `!pyobject Class` or {{type: !pyobject Class, kwargs: {{...}}}}; got keys {sorted(spec)}",
                )
            metrics[name] = (
                ref(spec["type"], "metric", key + ".type"),
                tree(spec.get("kwargs") or {}, key + ".kwargs"),
            )
        else:
            metrics[name] = (ref(spec, "metric", key), {})
    names = list(metrics) or ["loss"]
    for setting, watched in (
        ("checkpoint.metric", config.checkpoint.metric),
        ("early_stopping.metric", config.early_stopping.metric),
    ):
        if watched is not None and watched not in names:
            raise error(
                setting, f"no validation metric named {watched!r}; validation.metrics defines {names}"
            )
    return Resolved(
        optimizer_type=ref(t.optimizer_type, "torch.optim.Optimizer", "training.optimizer_type"),
        optimizer_kwargs=tree(t.optimizer_kwargs, "training.optimizer_kwargs"),
        scheduler_type=None
        if t.scheduler_type is None
        else ref(t.scheduler_type, "torch.optim.lr_scheduler.LRScheduler", "training.scheduler_type"),
        scheduler_kwargs=tree(t.scheduler_kwargs, "training.scheduler_kwargs"),
        loss=ref(t.loss, "callable", "training.loss"),
        model_type=ref(config.model.type, "model", "model.type"),
        model_kwargs=tree(config.model.kwargs, "model.kwargs"),
        data_build=ref(config.data.build, "callable", "data.build"),
        data_kwargs=tree(config.data.kwargs, "data.kwargs"),
        metrics=metrics,
        after_training=None
        if config.hooks.after_training is None
        else ref(config.hooks.after_training, "callable", "hooks.after_training"),
    )


def make_metrics(resolved: Resolved) -> dict[str, Any]:
    """Fresh metric objects for an evaluation; a ``Loss`` without ``loss_fn`` uses the training loss."""
    metrics = {}
    for name, (cls, kwargs) in resolved.metrics.items():
        if issubclass(cls, Loss) and "loss_fn" not in kwargs:
            kwargs = {"loss_fn": resolved.loss, **kwargs}
        metrics[name] = cls(**kwargs)
    return metrics or {"loss": Loss(resolved.loss)}


@dataclass
class RunContext:
    """What a run built, handed to hooks (``hooks.after_training``) and returned by :func:`run`."""

    config: Config
    run_dir: Path
    model: nn.Module
    optimizer: torch.optim.Optimizer
    trainer: Any
    evaluator: Any
    datasets: dict[str, Any]
    results: dict[str, Any] = field(default_factory=dict)


def scaled_lr(base: float, rule: str, world_size: int) -> float:
    """The learning rate after the scaling rule: ``none``, ``linear`` or ``sqrt`` in the world size."""
    if rule == "linear":
        return base * world_size
    if rule == "sqrt":
        return base * math.sqrt(world_size)
    return base


def _run_dir(config: Config, resume: str | None) -> tuple[Path, str | None]:
    """Rank 0 picks the run directory (and the checkpoint to resume); every rank gets it."""
    choice: tuple[str, str | None] | None = None
    if get_rank() == 0:
        root = Path(config.training.path or config.logging.root) / config.name
        if resume not in (None, "auto"):
            target = Path(resume)  # a checkpoint file, or a run directory
            run_dir = target.parent.parent if target.is_file() else target
            choice = (str(run_dir), str(target) if target.is_file() else "auto")
        else:
            previous = sorted(p for p in root.glob("*/checkpoints/manifest.json")) if resume == "auto" else []
            if previous:
                choice = (str(previous[-1].parent.parent), "auto")
            else:
                stamp = time.strftime("%Y%m%d-%H%M%S")
                run_dir = root / stamp
                n = 1
                while run_dir.exists():
                    run_dir = root / f"{stamp}-{n}"
                    n += 1
                choice = (str(run_dir), None)
            if resume == "auto" and not previous:
                _log.info("resume=auto: no earlier run of %r under %s; starting fresh.", config.name, root)
    choice = broadcast_object(choice)
    assert choice is not None
    return Path(choice[0]), choice[1]


def _file_logging(run_dir: Path) -> logging.Handler:
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(logs / f"rank{get_rank()}.log")
    handler.setFormatter(
        logging.Formatter(f"[rank {get_rank()}] %(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.getLogger("unison").addHandler(handler)
    return handler


def train_from_config(config: Config, resume: str | None = None) -> dict[str, Any]:
    """Runs on every rank: builds the run a config describes, trains, tests, and returns results.

    Distributed:
        Call it on every rank (``launch`` does): it is full of collectives.
    """
    resolved = resolve(config)
    run_dir, resume_from = _run_dir(config, resume)
    if get_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(config))
    barrier()  # the folder exists before any rank writes into it
    log_file = _file_logging(run_dir)
    try:
        return _train(config, resolved, run_dir, resume_from)
    finally:
        logging.getLogger("unison").removeHandler(log_file)
        log_file.close()


def _train(config: Config, resolved: Resolved, run_dir: Path, resume_from: str | None) -> dict[str, Any]:
    """Builds the run in its steps, resumes it when asked, trains, then tests and writes results."""
    world = get_world_size()
    _log.info("run directory: %s (world size %d)", run_dir, world)
    parts = build_run(config, resolved, run_dir, world)
    resume_run(parts, resume_from)
    t = config.training
    parts.trainer.run(parts.train_loader, max_epochs=t.max_epochs, epoch_length=t.epoch_length)
    results = collect_results(parts, run_dir, world)
    finish_run(config, resolved, parts, run_dir, results)
    return results


# -- the steps, in the order a run takes them -------------------------------------------------


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
        datasets: the datasets of :func:`build_datasets`.
        train_loader: the training loader of this rank (:func:`build_loaders`).
        val_loader: the validation loader of this rank, sharded without padding.
        model: the model on its device, wrapped for the world size (:func:`build_model`).
        optimizer: the optimizer over the model's parameters (:func:`build_optimizer`).
        scheduler: the learning-rate scheduler, or None.
        trainer: the training engine (:func:`build_trainer`).
        evaluator: the validation engine (:func:`build_evaluator`).
        watched: the validation metric that checkpoints, early stopping and a
            ``ReduceLROnPlateau`` scheduler watch.
        history: one row per validation, appended by the handler of :func:`attach_validation`.
        checkpoint: the checkpoint handler, None when ``checkpoint.enabled`` is false.
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


def build_run(config: Config, resolved: Resolved, run_dir: Path, world_size: int) -> RunParts:
    """Collective: call on every rank. Takes the build steps in order and attaches every handler.

    Args:
        config: the run's config.
        resolved: the objects it names (:func:`resolve`).
        run_dir: the run directory, the same on every rank.
        world_size: the number of ranks (it scales the learning rate).

    Returns:
        The parts, ready for :func:`resume_run` and ``parts.trainer.run``.
    """
    datasets = build_datasets(config, resolved)
    train_loader, val_loader = build_loaders(config, datasets)
    model = build_model(config, resolved)
    optimizer, scheduler = build_optimizer(config, resolved, model, world_size)
    trainer = build_trainer(config, resolved, model, optimizer)
    evaluator, watched = build_evaluator(config, resolved, model)
    parts = RunParts(
        datasets, train_loader, val_loader, model, optimizer, scheduler, trainer, evaluator, watched
    )
    attach_validation(config, parts)
    attach_scheduler(parts)
    attach_handlers(config, parts, run_dir)
    return parts


def build_datasets(config: Config, resolved: Resolved) -> Datasets:
    """Data, first half: seeds every generator with ``training.seed`` and calls ``data.build``.

    Raises:
        TypeError: ``data.build`` returned something other than 2 or 3 datasets.
    """
    seed = config.training.seed
    manual_seed(seed)
    built = resolved.data_build(seed=seed, **resolved.data_kwargs)
    if not isinstance(built, (tuple, list)) or len(built) not in (2, 3):
        raise TypeError(
            f"data.build must return (train, val) or (train, val, test) datasets, got {type(built).__name__}"
        )
    return Datasets(*built)


def build_loaders(config: Config, datasets: Datasets) -> tuple[DataLoader | None, DataLoader | None]:
    """Data, second half: this rank's training and validation loaders.

    The training loader takes the ``training`` section's loader keys (``batch_size``,
    ``num_workers``, ``pin_memory``, ``prefetch_factor``, ``drop_last``); the validation
    loader takes the ``validation`` section's (``batch_size``, default the training one;
    ``num_workers``), with ``training.pin_memory``, and ``training.prefetch_factor`` when
    it has worker processes of its own.

    Returns:
        ``(train_loader, val_loader)``, each None when its dataset is None.

    Distributed:
        Call it on every rank with the same config: the samplers shard by rank.
    """
    t, v = config.training, config.validation
    train_kwargs: dict[str, Any] = {"num_workers": t.num_workers, "pin_memory": t.pin_memory}
    val_kwargs: dict[str, Any] = {"num_workers": v.num_workers, "pin_memory": t.pin_memory}
    if t.prefetch_factor is not None:
        train_kwargs["prefetch_factor"] = t.prefetch_factor
        if v.num_workers > 0:  # a DataLoader without workers refuses prefetch_factor
            val_kwargs["prefetch_factor"] = t.prefetch_factor
    train_loader, _ = prepare_loaders(
        datasets.train, None, batch_size=t.batch_size, seed=t.seed, drop_last=t.drop_last, **train_kwargs
    )
    _, val_loader = prepare_loaders(
        None, datasets.val, batch_size=v.batch_size or t.batch_size, seed=t.seed, **val_kwargs
    )
    return train_loader, val_loader


def build_model(config: Config, resolved: Resolved) -> nn.Module:
    """Model: builds ``model.type(**model.kwargs)``, moves it to this rank's device and wraps it.

    Distributed:
        Call it on every rank: wrapping in DDP broadcasts rank 0's parameters.
    """
    return prepare_model(
        resolved.model_type(**resolved.model_kwargs),
        sync_batchnorm=config.parallel.sync_batchnorm,
        find_unused_parameters=config.parallel.find_unused_parameters,
    )


def build_optimizer(
    config: Config, resolved: Resolved, model: nn.Module, world_size: int
) -> tuple[torch.optim.Optimizer, Any]:
    """Optimizer and scheduler: ``training.lr`` overrides the optimizer's ``lr``, then scaled.

    The learning rate is scaled by ``training.lr_scaling`` in ``world_size`` (see
    :func:`scaled_lr`).

    Returns:
        ``(optimizer, scheduler)``; the scheduler is None without ``training.scheduler_type``.
    """
    t = config.training
    opt_kwargs = dict(resolved.optimizer_kwargs)
    if t.lr is not None:
        opt_kwargs["lr"] = t.lr
    if "lr" in opt_kwargs and t.lr_scaling != "none":
        base = float(opt_kwargs["lr"])
        opt_kwargs["lr"] = scaled_lr(base, t.lr_scaling, world_size)
        _log.info("lr scaling %r: %g x %d ranks -> lr %g", t.lr_scaling, base, world_size, opt_kwargs["lr"])
    optimizer = resolved.optimizer_type(model.parameters(), **opt_kwargs)
    scheduler = (
        resolved.scheduler_type(optimizer, **resolved.scheduler_kwargs) if resolved.scheduler_type else None
    )
    return optimizer, scheduler


def build_trainer(
    config: Config, resolved: Resolved, model: nn.Module, optimizer: torch.optim.Optimizer
) -> Engine:
    """Trainer: the training engine, with the ``training`` section's amp, accumulation and clipping."""
    t = config.training
    return create_trainer(
        model,
        optimizer,
        resolved.loss,
        amp=None if t.amp == "none" else t.amp,
        accumulation_steps=t.accumulation_steps,
        clip_grad_norm=t.clip_grad_norm,
        sync_every=t.sync_every,
    )


def build_evaluator(config: Config, resolved: Resolved, model: nn.Module) -> tuple[Engine, str]:
    """Evaluator: the validation engine with fresh metrics, and the metric the run watches.

    Returns:
        ``(evaluator, watched)``: ``watched`` is ``checkpoint.metric``, default the first
        validation metric.

    Raises:
        ConfigError: ``checkpoint.metric`` names no validation metric.
    """
    amp = config.training.amp
    metrics = make_metrics(resolved)
    evaluator = create_evaluator(model, metrics, amp=None if amp == "none" else amp)
    watched = config.checkpoint.metric or next(iter(metrics))
    if watched not in metrics:
        raise ConfigError(
            f"no validation metric named {watched!r}; metrics: {sorted(metrics)}",
            key=["checkpoint", "metric"],
        )
    return evaluator, watched


def attach_validation(config: Config, parts: RunParts) -> None:
    """Evaluator, wired: evaluates every ``validation.every`` epochs and at the last one.

    Each evaluation appends a row (epoch, training loss, ``val_<metric>``) to
    ``parts.history`` and logs one line.

    Distributed:
        Every rank attaches it: evaluating is a collective.
    """
    evaluator, history = parts.evaluator, parts.history

    def validate(engine: Engine) -> None:
        if engine.state.epoch % config.validation.every and engine.state.epoch != engine.state.max_epochs:
            return
        values = evaluator.run(parts.val_loader).metrics
        row = {"epoch": engine.state.epoch, "train_loss": engine.state.metrics.get("loss")}
        row.update({f"val_{k}": v for k, v in values.items() if isinstance(v, float)})
        history.append(row)
        shown = "  ".join(f"val {k} {v:.4f}" for k, v in values.items() if isinstance(v, float))
        _log.info(
            "epoch %d/%d  train loss %.4f  %s",
            engine.state.epoch,
            engine.state.max_epochs,
            row["train_loss"],
            shown,
        )

    parts.trainer.add_event_handler(Events.EPOCH_COMPLETED, validate)


def attach_scheduler(parts: RunParts) -> None:
    """Scheduler, wired: steps once per epoch, after validation (on the watched metric for plateaus)."""
    scheduler, evaluator, watched = parts.scheduler, parts.evaluator, parts.watched
    if scheduler is None:
        return
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        parts.trainer.add_event_handler(
            Events.EPOCH_COMPLETED, lambda e: scheduler.step(evaluator.state.metrics[watched])
        )
    else:
        parts.trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: scheduler.step())


def attach_handlers(config: Config, parts: RunParts, run_dir: Path) -> None:
    """Handlers: early stopping and guards, the checkpoint (and preemption), logging, progress.

    Sets ``parts.checkpoint``.

    Distributed:
        Every rank attaches every handler; each filters by rank inside its side effects.
    """
    to_save = checkpoint_objects(parts)
    attach_control(config, parts, run_dir, to_save)
    parts.checkpoint = attach_checkpoint(config, parts, run_dir, to_save)
    attach_logging(config, parts, run_dir)


def checkpoint_objects(parts: RunParts) -> dict[str, Any]:
    """What a checkpoint holds: model, optimizer, and the scheduler and grad scaler when there are."""
    to_save: dict[str, Any] = {"model": parts.model, "optimizer": parts.optimizer}
    if parts.scheduler is not None:
        to_save["scheduler"] = parts.scheduler
    step = cast(TrainStep, parts.trainer.process_function)
    if step.scaler is not None:
        to_save["scaler"] = step.scaler
    return to_save


def attach_control(config: Config, parts: RunParts, run_dir: Path, to_save: dict[str, Any]) -> None:
    """Handlers that stop or watch the run: early stopping, non-finite guard, time limit, watchdog.

    Early stopping, when ``early_stopping.patience`` is set, joins ``to_save``.
    """
    t, es = config.training, config.early_stopping
    trainer, evaluator = parts.trainer, parts.evaluator
    if es.patience is not None:
        stopper = EarlyStopping(
            trainer,
            es.metric or parts.watched,
            patience=es.patience,
            mode=es.mode or config.checkpoint.mode,
            min_delta=es.min_delta,
            threshold_mode=es.threshold_mode,
            cumulative_delta=es.cumulative_delta,
            agreement=es.agreement,
        )
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
    config: Config, parts: RunParts, run_dir: Path, to_save: dict[str, Any]
) -> Checkpoint | None:
    """The checkpoint handler, writing ``to_save`` to ``run_dir/checkpoints``, and preemption.

    Returns:
        The checkpoint handler, or None when ``checkpoint.enabled`` is false.
    """
    ck = config.checkpoint
    if not ck.enabled:
        return None
    checkpoint = Checkpoint(
        run_dir / "checkpoints",
        to_save,
        parts.trainer,
        every_epochs=config.training.checkpoint_at or ck.every_epochs,
        every_iters=ck.every_iters,
        keep_last=ck.keep_last,
        keep_best=ck.keep_best,
        metric=parts.watched,
        mode=ck.mode,
        metric_engine=parts.evaluator,
        async_save=ck.async_save,
        config=to_plain(config),
    )
    checkpoint.attach()
    if ck.preemption:
        Preemption(checkpoint, requeue=ck.requeue).attach(parts.trainer)
    return checkpoint


def attach_logging(config: Config, parts: RunParts, run_dir: Path) -> None:
    """TensorBoard event files in ``run_dir/tb`` and the progress bar, as ``logging`` asks."""
    if config.logging.tensorboard:
        try:
            from unison.handlers.tensorboard import TensorBoardLogger
        except ImportError as err:  # pragma: no cover - tensorboardX is a dependency
            _log.warning("TensorBoard logging is off: %s", err)
        else:
            TensorBoardLogger(
                run_dir / "tb",
                trainer=parts.trainer,
                evaluators={"val": parts.evaluator},
                log_every=config.logging.log_every,
            ).attach(parts.trainer)
    if config.logging.progress:
        ProgressBar().attach(parts.trainer)


def resume_run(parts: RunParts, resume_from: str | None) -> Path | None:
    """Resume: loads ``resume_from`` (``"auto"`` or a checkpoint file) into the parts.

    Nothing happens without a checkpoint handler or without ``resume_from``.

    Returns:
        The checkpoint file resumed from, or None for a fresh start.

    Distributed:
        Collective: call on every rank, before ``parts.trainer.run``.
    """
    if parts.checkpoint is None or resume_from is None:
        return None
    return parts.checkpoint.resume(resume_from)


def collect_results(parts: RunParts, run_dir: Path, world_size: int) -> dict[str, Any]:
    """The results of training: counters, final training loss and validation metrics, history."""
    trainer, evaluator = parts.trainer, parts.evaluator
    return {
        "run_dir": str(run_dir),
        "world_size": world_size,
        "epochs": trainer.state.epoch,
        "iterations": trainer.state.iteration,
        "train_loss": trainer.state.metrics.get("loss"),
        "validation": {k: v for k, v in evaluator.state.metrics.items() if isinstance(v, float)},
        "history": parts.history,
    }


def finish_run(
    config: Config, resolved: Resolved, parts: RunParts, run_dir: Path, results: dict[str, Any]
) -> None:
    """Test phase: the test set, predictions, the recipe's ``hooks.after_training``, metrics.json.

    Adds ``test`` and ``predictions`` to ``results`` when they are made; rank 0 writes
    ``run_dir/metrics.json`` last, after the hook (which may add results of its own).

    Distributed:
        Collective: call on every rank.
    """
    datasets = parts.datasets
    if datasets.test is not None and config.testing.enabled:
        results["test"] = evaluate_test_set(config, resolved, parts)
    if config.predict.enabled:
        written = write_predictions(config, parts, run_dir)
        if written is not None:
            results["predictions"] = str(written)
    context = RunContext(
        config,
        run_dir,
        parts.model,
        parts.optimizer,
        parts.trainer,
        parts.evaluator,
        {"train": datasets.train, "val": datasets.val, "test": datasets.test},
        results,
    )
    if resolved.after_training is not None:
        resolved.after_training(context)
    if get_rank() == 0:
        (run_dir / "metrics.json").write_text(json.dumps(results, indent=2, default=str) + "\n")


def evaluate_test_set(config: Config, resolved: Resolved, parts: RunParts) -> dict[str, float]:
    """Test phase: evaluates the test set, with the best checkpoint's weights if ``testing.use_best``.

    Returns:
        The test metrics, by name.

    Distributed:
        Collective: call on every rank.
    """
    from unison.checkpoint import load_checkpoint, load_model_state

    checkpoint, model = parts.checkpoint, parts.model
    if config.testing.use_best and checkpoint is not None:
        best = checkpoint.best if get_rank() == 0 else None
        path = broadcast_object(None if best is None else str(checkpoint.folder / best.file))
        if path is not None:
            load_model_state(model, load_checkpoint(path)["objects"]["model"])
            _log.info("testing the best checkpoint %s", path)
    metrics = make_metrics(resolved)
    amp = config.training.amp
    batch = config.testing.batch_size or config.validation.batch_size or config.training.batch_size
    _, test_loader = prepare_loaders(None, parts.datasets.test, batch_size=batch)
    tester = create_evaluator(model, metrics, amp=None if amp == "none" else amp)
    values = {k: v for k, v in tester.run(test_loader).metrics.items() if isinstance(v, float)}
    _log.info("test: %s", "  ".join(f"{k} {v:.4f}" for k, v in values.items()))
    return values


def write_predictions(config: Config, parts: RunParts, run_dir: Path) -> Path | None:
    """Test phase: predicts the test set (else the validation set) into ``run_dir/predictions.pt``.

    Returns:
        The file, on rank 0; None on the other ranks.

    Distributed:
        Collective: call on every rank; rank 0 gathers and writes.
    """
    datasets = parts.datasets
    target = datasets.test if datasets.test is not None else datasets.val
    batch = config.predict.batch_size or config.validation.batch_size or config.training.batch_size
    out = predict(parts.model, target, batch_size=batch)
    if get_rank() != 0 or out is None:
        return None
    path = run_dir / "predictions.pt"
    torch.save(out, path)
    return path


def run(
    config: Config | str | os.PathLike[str],
    *,
    nproc: int | None = None,
    overrides: list[str] | None = None,
    resume: str | None = None,
) -> dict[str, Any]:
    """Trains what a config describes: spawned locally, or as one rank under torchrun/SLURM.

    The config is read, validated and every ``!pyobject`` resolved here, before any rank
    starts: a mistake fails at once, naming the file, the line and the key.

    Args:
        config: a config file, or a :class:`~unison.config.Config`.
        nproc: ranks to spawn; default ``parallel.nproc_per_node`` (ignored under a
            launcher, which has started the ranks already).
        overrides: ``KEY.PATH=VALUE`` settings, as ``--set`` on the command line.
        resume: ``"auto"`` (the newest run of this config's name with a checkpoint),
            a checkpoint file, or a run directory.

    Returns:
        Rank 0's results: run directory, final metrics, history (and test metrics).
    """
    if not isinstance(config, Config):
        config = load_config(config, overrides)
    elif overrides:
        raise ValueError("run(overrides=...) applies to a config file; edit the Config object instead.")
    resolve(config)  # fail before spawning
    launcher = detect_launcher()
    if launcher.kind != "none":
        if nproc is not None:
            raise ValueError(
                f"--nproc {nproc} was given, but this process is already one rank started by {launcher.describe()}; "
                "leave --nproc out under torchrun or srun."
            )
        nproc_per_node = None
    else:
        nproc_per_node = nproc if nproc is not None else config.parallel.nproc_per_node
    results = launch(
        train_from_config,
        config,
        resume,
        nproc_per_node=nproc_per_node,
        backend=config.parallel.backend,
        timeout=config.parallel.timeout,
        master_addr=config.parallel.master_addr,
        master_port=None if config.parallel.master_port is None else int(config.parallel.master_port),
    )
    return results[0]
