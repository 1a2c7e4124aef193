"""Importing and type-checking what a config names, before any rank is spawned.

:func:`resolve` imports every ``!pyobject`` of a config through the allow-list
(:func:`unison.config.resolve_ref`) into a :class:`Resolved`, one slot family at a time:
metrics (and the metric that checkpoints and early stopping watch), optimizer, scheduler,
loss, model, data and hooks. :func:`make_metrics` and :func:`scaled_lr` turn what it
resolved into the objects and numbers a run uses.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from unison.config import Config, ConfigError, PyObjectRef, resolve_ref, resolve_tree
from unison.metrics import Loss


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

    The config's folder joins ``sys.path`` (the recipe's own modules; spawned ranks
    inherit it). The slot families go in a fixed order: metrics (and the metric that
    checkpoints and early stopping watch), optimizer, scheduler, loss, model, data, hooks.

    Raises:
        ConfigError: for the first reference that is refused, missing or of the wrong kind.
    """
    refs = _References.of(config)
    metrics = _metric_slots(config, refs)
    _check_watched_metrics(config, list(metrics) or ["loss"], refs)
    optimizer_type, optimizer_kwargs = _optimizer_slots(config, refs)
    scheduler_type, scheduler_kwargs = _scheduler_slots(config, refs)
    loss = _loss_slot(config, refs)
    model_type, model_kwargs = _model_slots(config, refs)
    data_build, data_kwargs = _data_slots(config, refs)
    return Resolved(
        optimizer_type=optimizer_type,
        optimizer_kwargs=optimizer_kwargs,
        scheduler_type=scheduler_type,
        scheduler_kwargs=scheduler_kwargs,
        loss=loss,
        model_type=model_type,
        model_kwargs=model_kwargs,
        data_build=data_build,
        data_kwargs=data_kwargs,
        metrics=metrics,
        after_training=_hook_slots(config, refs),
    )


def make_metrics(resolved: Resolved) -> dict[str, Any]:
    """Fresh metric objects for an evaluation; a ``Loss`` without ``loss_fn`` uses the training loss."""
    metrics = {}
    for name, (cls, kwargs) in resolved.metrics.items():
        if issubclass(cls, Loss) and "loss_fn" not in kwargs:
            kwargs = {"loss_fn": resolved.loss, **kwargs}
        metrics[name] = cls(**kwargs)
    return metrics or {"loss": Loss(resolved.loss)}


def scaled_lr(base: float, rule: str, world_size: int) -> float:
    """The learning rate after the scaling rule: ``none``, ``linear`` or ``sqrt`` in the world size."""
    if rule == "linear":
        return base * world_size
    if rule == "sqrt":
        return base * math.sqrt(world_size)
    return base


@dataclass(frozen=True)
class _References:
    """How one config's references resolve: its imports, its folder, and its lines for errors."""

    source: str | None
    config_dir: Path | None
    imports: list[str]
    lines: dict[tuple[str, ...], int]

    @classmethod
    def of(cls, config: Config) -> _References:
        """The references of ``config``; puts the config's folder on ``sys.path``."""
        source = getattr(config, "source", None)
        config_dir = Path(source).parent if source else None
        if config_dir is not None and str(config_dir) not in sys.path:
            sys.path.insert(0, str(config_dir))  # the recipe's own modules; spawned ranks inherit it
        return cls(source, config_dir, list(config.imports), getattr(config, "lines", {}))

    def ref(self, value: Any, slot: str | None, key: str) -> Any:
        """The object ``value`` names, checked to fit ``slot``, for the key path ``key``."""
        return resolve_ref(value, slot=slot, key=key, imports=self.imports, config_dir=self.config_dir)

    def tree(self, value: Any, key: str) -> Any:
        """``value`` with every reference nested in it resolved, for the key path ``key``."""
        return resolve_tree(value, key=key, imports=self.imports, config_dir=self.config_dir)

    def error(self, key: str, message: str) -> ConfigError:
        """A config error at the dotted key path ``key``, with its file and line."""
        path = key.split(".")
        return ConfigError(message, file=self.source, line=self.lines.get(tuple(path)), key=path)


# -- one function per slot family, in the order resolve() takes them ----------------------------


def _metric_slots(config: Config, refs: _References) -> dict[str, tuple[type, dict[str, Any]]]:
    """``validation.metrics``: each a metric class, with the kwargs to build it with."""
    return {
        name: _metric_slot(f"validation.metrics.{name}", spec, refs)
        for name, spec in config.validation.metrics.items()
    }


def _metric_slot(key: str, spec: Any, refs: _References) -> tuple[type, dict[str, Any]]:
    """One metric: ``!pyobject Class`` or ``{type: !pyobject Class, kwargs: {...}}``."""
    if not isinstance(spec, (dict, PyObjectRef)):
        raise refs.error(
            key,
            f"a metric is `!pyobject Class` or {{type: !pyobject Class, kwargs: {{...}}}}, got {spec!r}",
        )
    if not isinstance(spec, dict):
        return refs.ref(spec, "metric", key), {}
    unknown = set(spec) - {"type", "kwargs"}
    if "type" not in spec or unknown:
        raise refs.error(
            key,
            f"a metric is `!pyobject Class` or {{type: !pyobject Class, kwargs: {{...}}}}; got keys {sorted(spec)}",
        )
    cls = refs.ref(spec["type"], "metric", key + ".type")
    return cls, refs.tree(spec.get("kwargs") or {}, key + ".kwargs")


def _check_watched_metrics(config: Config, names: list[str], refs: _References) -> None:
    """``checkpoint.metric`` and ``early_stopping.metric`` name one of the validation metrics."""
    for setting, watched in (
        ("checkpoint.metric", config.checkpoint.metric),
        ("early_stopping.metric", config.early_stopping.metric),
    ):
        if watched is not None and watched not in names:
            raise refs.error(
                setting, f"no validation metric named {watched!r}; validation.metrics defines {names}"
            )


def _optimizer_slots(config: Config, refs: _References) -> tuple[type, dict[str, Any]]:
    """``training.optimizer_type`` (an optimizer class) and ``training.optimizer_kwargs``."""
    t = config.training
    return (
        refs.ref(t.optimizer_type, "torch.optim.Optimizer", "training.optimizer_type"),
        refs.tree(t.optimizer_kwargs, "training.optimizer_kwargs"),
    )


def _scheduler_slots(config: Config, refs: _References) -> tuple[type | None, dict[str, Any]]:
    """``training.scheduler_type`` (a scheduler class, or None) and ``training.scheduler_kwargs``."""
    t = config.training
    scheduler_type = (
        None
        if t.scheduler_type is None
        else refs.ref(t.scheduler_type, "torch.optim.lr_scheduler.LRScheduler", "training.scheduler_type")
    )
    return scheduler_type, refs.tree(t.scheduler_kwargs, "training.scheduler_kwargs")


def _loss_slot(config: Config, refs: _References) -> Callable[..., torch.Tensor]:
    """``training.loss``: a callable of ``(output, target)``."""
    return refs.ref(config.training.loss, "callable", "training.loss")


def _model_slots(config: Config, refs: _References) -> tuple[Callable[..., nn.Module], dict[str, Any]]:
    """``model.type`` (a model class or factory) and ``model.kwargs``."""
    return refs.ref(config.model.type, "model", "model.type"), refs.tree(config.model.kwargs, "model.kwargs")


def _data_slots(config: Config, refs: _References) -> tuple[Callable[..., Any], dict[str, Any]]:
    """``data.build`` (a callable returning the datasets) and ``data.kwargs``."""
    return refs.ref(config.data.build, "callable", "data.build"), refs.tree(config.data.kwargs, "data.kwargs")


def _hook_slots(config: Config, refs: _References) -> Callable[[Any], Any] | None:
    """``hooks.after_training``: a callable of the run's context, or None."""
    hook = config.hooks.after_training
    return None if hook is None else refs.ref(hook, "callable", "hooks.after_training")
