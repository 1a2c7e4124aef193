"""Wiring a validated config into a training run: the code behind ``unison run``.

Everything a config can name is checked in the launching process, before any rank is
spawned; each rank then builds the same objects and attaches the same handlers.
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
from unison.engine import Events, TrainStep, create_evaluator, create_trainer
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
    t = config.training
    world = get_world_size()
    _log.info("run directory: %s (world size %d)", run_dir, world)

    manual_seed(t.seed)
    built = resolved.data_build(seed=t.seed, **resolved.data_kwargs)
    if not isinstance(built, (tuple, list)) or len(built) not in (2, 3):
        raise TypeError(
            f"data.build must return (train, val) or (train, val, test) datasets, got {type(built).__name__}"
        )
    train_set, val_set, test_set = (*built, None)[:3]
    loader_kwargs: dict[str, Any] = {"num_workers": t.num_workers, "pin_memory": t.pin_memory}
    if t.prefetch_factor is not None:
        loader_kwargs["prefetch_factor"] = t.prefetch_factor
    train_loader, val_loader = prepare_loaders(
        train_set,
        val_set,
        batch_size=t.batch_size,
        val_batch_size=config.validation.batch_size,
        seed=t.seed,
        drop_last=t.drop_last,
        **loader_kwargs,
    )

    model = prepare_model(
        resolved.model_type(**resolved.model_kwargs),
        sync_batchnorm=config.parallel.sync_batchnorm,
        find_unused_parameters=config.parallel.find_unused_parameters,
    )
    opt_kwargs = dict(resolved.optimizer_kwargs)
    if t.lr is not None:
        opt_kwargs["lr"] = t.lr
    if "lr" in opt_kwargs and t.lr_scaling != "none":
        base = float(opt_kwargs["lr"])
        opt_kwargs["lr"] = scaled_lr(base, t.lr_scaling, world)
        _log.info("lr scaling %r: %g x %d ranks -> lr %g", t.lr_scaling, base, world, opt_kwargs["lr"])
    optimizer = resolved.optimizer_type(model.parameters(), **opt_kwargs)
    scheduler = (
        resolved.scheduler_type(optimizer, **resolved.scheduler_kwargs) if resolved.scheduler_type else None
    )

    sync_every = t.sync_every
    trainer = create_trainer(
        model,
        optimizer,
        resolved.loss,
        amp=None if t.amp == "none" else t.amp,
        accumulation_steps=t.accumulation_steps,
        clip_grad_norm=t.clip_grad_norm,
        sync_every=sync_every,
    )
    metrics = make_metrics(resolved)
    evaluator = create_evaluator(model, metrics, amp=None if t.amp == "none" else t.amp)
    watched = config.checkpoint.metric or next(iter(metrics))
    if watched not in metrics:
        raise ConfigError(
            f"no validation metric named {watched!r}; metrics: {sorted(metrics)}",
            key=["checkpoint", "metric"],
        )

    history: list[dict[str, Any]] = []

    def validate(engine: Any) -> None:
        if engine.state.epoch % config.validation.every and engine.state.epoch != engine.state.max_epochs:
            return
        values = evaluator.run(val_loader).metrics
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

    trainer.add_event_handler(Events.EPOCH_COMPLETED, validate)
    if scheduler is not None:
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            trainer.add_event_handler(
                Events.EPOCH_COMPLETED, lambda e: scheduler.step(evaluator.state.metrics[watched])
            )
        else:
            trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: scheduler.step())

    to_save: dict[str, Any] = {"model": model, "optimizer": optimizer}
    if scheduler is not None:
        to_save["scheduler"] = scheduler
    step = cast(TrainStep, trainer.process_function)
    if step.scaler is not None:
        to_save["scaler"] = step.scaler
    es = config.early_stopping
    if es.patience is not None:
        stopper = EarlyStopping(
            trainer,
            es.metric or watched,
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

    checkpoint = None
    ck = config.checkpoint
    if ck.enabled:
        checkpoint = Checkpoint(
            run_dir / "checkpoints",
            to_save,
            trainer,
            every_epochs=t.checkpoint_at or ck.every_epochs,
            every_iters=ck.every_iters,
            keep_last=ck.keep_last,
            keep_best=ck.keep_best,
            metric=watched,
            mode=ck.mode,
            metric_engine=evaluator,
            async_save=ck.async_save,
            config=to_plain(config),
        )
        checkpoint.attach()
        if ck.preemption:
            Preemption(checkpoint, requeue=ck.requeue).attach(trainer)
        if resume_from is not None:
            checkpoint.resume(resume_from)
    if config.logging.tensorboard:
        _attach_tensorboard(run_dir, trainer, evaluator, config)
    if config.logging.progress:
        ProgressBar().attach(trainer)

    trainer.run(train_loader, max_epochs=t.max_epochs, epoch_length=t.epoch_length)

    results: dict[str, Any] = {
        "run_dir": str(run_dir),
        "world_size": world,
        "epochs": trainer.state.epoch,
        "iterations": trainer.state.iteration,
        "train_loss": trainer.state.metrics.get("loss"),
        "validation": {k: v for k, v in evaluator.state.metrics.items() if isinstance(v, float)},
        "history": history,
    }
    if test_set is not None and config.testing.enabled:
        results["test"] = _test(config, checkpoint, model, test_set, resolved)
    if config.predict.enabled:
        target = test_set if test_set is not None else val_set
        out = predict(
            model,
            target,
            batch_size=config.predict.batch_size or config.validation.batch_size or t.batch_size,
        )
        if get_rank() == 0 and out is not None:
            torch.save(out, run_dir / "predictions.pt")
            results["predictions"] = str(run_dir / "predictions.pt")
    context = RunContext(
        config,
        run_dir,
        model,
        optimizer,
        trainer,
        evaluator,
        {"train": train_set, "val": val_set, "test": test_set},
        results,
    )
    if resolved.after_training is not None:
        resolved.after_training(context)
    if get_rank() == 0:
        (run_dir / "metrics.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    return results


def _test(
    config: Config, checkpoint: Checkpoint | None, model: nn.Module, test_set: Any, resolved: Resolved
) -> dict[str, float]:
    from unison.checkpoint import load_checkpoint, load_model_state

    if config.testing.use_best and checkpoint is not None:
        best = checkpoint.best if get_rank() == 0 else None
        path = broadcast_object(None if best is None else str(checkpoint.folder / best.file))
        if path is not None:
            load_model_state(model, load_checkpoint(path)["objects"]["model"])
            _log.info("testing the best checkpoint %s", path)
    metrics = make_metrics(resolved)
    amp = config.training.amp
    batch = config.testing.batch_size or config.validation.batch_size or config.training.batch_size
    _, test_loader = prepare_loaders(None, test_set, batch_size=batch)
    tester = create_evaluator(model, metrics, amp=None if amp == "none" else amp)
    values = {k: v for k, v in tester.run(test_loader).metrics.items() if isinstance(v, float)}
    _log.info("test: %s", "  ".join(f"{k} {v:.4f}" for k, v in values.items()))
    return values


def _attach_tensorboard(run_dir: Path, trainer: Any, evaluator: Any, config: Config) -> None:
    try:
        from unison.handlers.tensorboard import TensorBoardLogger
    except ImportError as err:  # pragma: no cover - tensorboardX is a dependency
        _log.warning("TensorBoard logging is off: %s", err)
        return
    TensorBoardLogger(
        run_dir / "tb", trainer=trainer, evaluators={"val": evaluator}, log_every=config.logging.log_every
    ).attach(trainer)


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
