"""Importing and type-checking what a config names, and checking the run, before any rank is spawned.

:func:`resolve` imports every ``!pyobject`` of a config into a :class:`Resolved`, one slot
family at a time (metrics and the metric that checkpoints and early stopping watch,
optimizer, scheduler, loss, model, data, hooks). Each object is checked against its typed
slot (:data:`unison.config.resolve.SLOTS`) before anything is called, and every kwargs
mapping is bound against the signature it will be called with. :func:`preflight` then
builds the model on the ``meta`` device with its optimizer and scheduler, and checks the
device and the output folder. :func:`make_metrics` and :func:`scaled_lr` turn what
:func:`resolve` found into the objects and numbers a run uses.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from unison.config import Config, ConfigError, PyObjectRef, resolve_tree
from unison.config.resolve import Scope, lookup
from unison.config.usercode import describe, refused_import
from unison.metrics import Loss
from unison.utils import get_logger

_log = get_logger("unison.cli.resolve")


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
    """Imports every ``!pyobject`` of ``config``, checks its slot, and binds its kwargs.

    Modules beside the config are imported by file path (``sys.path`` is left alone);
    ``imports:`` is checked to name the user's own modules only. The slot families go in
    a fixed order: metrics (and the metric that checkpoints and early stopping watch),
    optimizer, scheduler, loss, model, data, hooks. Nothing the config names is called,
    except a loss given as a ``torch.nn.Module`` class, which is built with no arguments.

    Raises:
        ConfigError: for the first reference that is refused, missing or of the wrong kind,
            or kwargs that do not fit the signature they will be called with.
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


def preflight(config: Config, resolved: Resolved) -> None:
    """Checks, in the launching process, what would otherwise fail only once ranks run.

    Checks ``training.device`` against this machine and that the output folder
    (``training.path`` or ``logging.root``) can be written; builds the model on the
    ``meta`` device (no memory, no data), the optimizer on its parameters and the
    scheduler on that optimizer, and the validation metrics. The data builder is not
    called (it may be expensive): :func:`resolve` checked its signature.

    Raises:
        ConfigError: naming the file, line and key of the first problem.
    """
    refs = _References.of(config)
    _check_device(config, refs)
    _check_output_root(config, refs)
    model = _meta_model(resolved, refs)
    if model is not None:
        _meta_optimizer(config, resolved, model, refs)
    for name, (cls, kwargs) in resolved.metrics.items():
        if issubclass(cls, Loss) and "loss_fn" not in kwargs:
            kwargs = {"loss_fn": resolved.loss, **kwargs}
        try:
            cls(**kwargs)
        except Exception as err:
            raise refs.error(
                f"validation.metrics.{name}", f"building {describe(cls)} raised {type(err).__name__}: {err}"
            ) from err


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
    scope: Scope
    lines: dict[tuple[str, ...], int]
    overrides: dict[tuple[str, ...], str]

    @classmethod
    def of(cls, config: Config) -> _References:
        """The references of ``config``; refuses an ``imports:`` entry that is not the user's own code."""
        source = getattr(config, "source", None)
        config_dir = Path(source).parent if source else None
        refs = cls(
            source,
            Scope(tuple(config.imports), config_dir),
            getattr(config, "lines", {}),
            getattr(config, "overrides", {}),
        )
        for i, entry in enumerate(config.imports):
            why = refused_import(entry, config_dir)
            if why is not None:
                raise refs.error(f"imports.{i}", f"{entry!r} is refused: {why}")
        return refs

    def ref(self, value: Any, slot: str, key: str) -> Any:
        """The object ``value`` names, checked to fit ``slot``, for the key path ``key``."""
        return lookup(value, slot=slot, key=key, scope=self.scope)[0]

    def tree(self, value: Any, key: str) -> dict[str, Any]:
        """The kwargs mapping ``value`` with every reference in it resolved as a value."""
        if not isinstance(value, dict):
            raise self.error(key, f"expected a mapping of keyword arguments, got {type(value).__name__}")
        for name in value:
            if not isinstance(name, str) or not name.isidentifier():
                raise self.error(
                    f"{key}.{name}",
                    f"a keyword argument's name is a word, got {type(name).__name__} {name!r}; quote it or rename it",
                )
        return dict(
            resolve_tree(value, key=key, imports=self.scope.imports, config_dir=self.scope.config_dir)
        )

    def error(self, key: str, message: str) -> ConfigError:
        """A config error at the dotted key path ``key``, with its file and line (or its ``--set``)."""
        path = tuple(key.split("."))
        for i in range(len(path), 0, -1):
            if path[:i] in self.overrides:
                return ConfigError(message, file=f"--set {self.overrides[path[:i]]}", key=path)
        line = None
        for i in range(len(path), 0, -1):
            if path[:i] in self.lines:
                line = self.lines[path[:i]]
                break
        return ConfigError(message, file=self.source, line=line, key=path)

    def bind(
        self,
        fn: Any,
        *,
        type_key: str,
        kwargs_key: str,
        kwargs: dict[str, Any],
        args: tuple[Any, ...] = (),
        supplied: dict[str, Any] | None = None,
        how: str = "",
    ) -> None:
        """Checks ``fn(*args, **supplied, **kwargs)`` binds, naming the kwargs key that does not.

        ``args`` and ``supplied`` are what unison passes itself (the parameters, the
        optimizer, the seed ...); ``how`` says so in messages.
        """
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # a built-in without a signature: nothing to check
            return
        supplied = dict(supplied or {})
        try:
            signature.bind(*args, **supplied, **kwargs)
            return
        except TypeError as err:
            problem = str(err)
        params = signature.parameters
        named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        what = describe(fn)
        if not takes_any:
            for name in kwargs:
                if name not in named:
                    near = difflib.get_close_matches(name, named, n=1, cutoff=0.6)
                    hint = f" Did you mean {near[0]!r}?" if near else ""
                    raise self.error(
                        f"{kwargs_key}.{name}",
                        f"{what} takes no argument {name!r}; it takes {', '.join(named) or 'none'}.{hint}",
                    )
        missing = problem.partition("missing a required argument: ")[2]
        if missing:
            raise self.error(type_key, f"{what}{how} needs the argument {missing}; add it under {kwargs_key}")
        key = kwargs_key if kwargs else type_key
        raise self.error(key, f"{what}{how} cannot be called with {kwargs_key} = {kwargs}: {problem}")


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
        cls, kwargs, type_key = refs.ref(spec, "metric", key), {}, key
    else:
        unknown = set(spec) - {"type", "kwargs"}
        if "type" not in spec or unknown or not isinstance(spec["type"], PyObjectRef):
            raise refs.error(
                key,
                f"a metric is `!pyobject Class` or {{type: !pyobject Class, kwargs: {{...}}}}; got keys {sorted(spec)}",
            )
        type_key = key + ".type"
        cls = refs.ref(spec["type"], "metric", type_key)
        kwargs = refs.tree(spec.get("kwargs") or {}, key + ".kwargs")
    supplied = {"loss_fn": None} if issubclass(cls, Loss) and "loss_fn" not in kwargs else {}
    refs.bind(
        cls,
        type_key=type_key,
        kwargs_key=key + ".kwargs",
        kwargs=kwargs,
        supplied=supplied,
        how=" (loss_fn defaults to training.loss)" if supplied else "",
    )
    return cls, kwargs


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
    cls = refs.ref(t.optimizer_type, "optimizer", "training.optimizer_type")
    kwargs = refs.tree(t.optimizer_kwargs, "training.optimizer_kwargs")
    refs.bind(
        cls,
        type_key="training.optimizer_type",
        kwargs_key="training.optimizer_kwargs",
        kwargs={**kwargs, **({"lr": t.lr} if t.lr is not None else {})},
        args=([],),
        how="(params, ...)",
    )
    return cls, kwargs


def _scheduler_slots(config: Config, refs: _References) -> tuple[type | None, dict[str, Any]]:
    """``training.scheduler_type`` (a scheduler class, or None) and ``training.scheduler_kwargs``."""
    t = config.training
    kwargs = refs.tree(t.scheduler_kwargs, "training.scheduler_kwargs")
    if t.scheduler_type is None:
        return None, kwargs
    cls = refs.ref(t.scheduler_type, "scheduler", "training.scheduler_type")
    refs.bind(
        cls,
        type_key="training.scheduler_type",
        kwargs_key="training.scheduler_kwargs",
        kwargs=kwargs,
        args=(object(),),
        how="(optimizer, ...)",
    )
    return cls, kwargs


def _loss_slot(config: Config, refs: _References) -> Callable[..., torch.Tensor]:
    """``training.loss``: a function of ``(output, target)``, a loss module, or a loss module class.

    A ``torch.nn.Module`` class (``torch.nn.CrossEntropyLoss``) is built here with no
    arguments; one that needs arguments is refused (name an instance of your own module).
    """
    key = "training.loss"
    loss = refs.ref(config.training.loss, "loss", key)
    if isinstance(loss, type):
        try:
            inspect.signature(loss).bind()
        except TypeError as err:
            raise refs.error(
                key,
                f"{describe(loss)} needs arguments ({err}); training.loss builds a loss class with none. "
                "Define an instance in your own module (my_loss = FocalLoss(gamma=2)) and name it",
            ) from None
        except ValueError:
            pass
        return loss()
    if not isinstance(loss, nn.Module):
        refs.bind(loss, type_key=key, kwargs_key=key, kwargs={}, args=(None, None), how="(output, target)")
    return loss


def _model_slots(config: Config, refs: _References) -> tuple[Callable[..., nn.Module], dict[str, Any]]:
    """``model.type`` (a model class, or a function of the user's returning one) and ``model.kwargs``."""
    model_type = refs.ref(config.model.type, "model", "model.type")
    kwargs = refs.tree(config.model.kwargs, "model.kwargs")
    refs.bind(model_type, type_key="model.type", kwargs_key="model.kwargs", kwargs=kwargs)
    if isinstance(model_type, type):
        return model_type, kwargs
    return _checked_factory(model_type, refs), kwargs


def _checked_factory(fn: Callable[..., Any], refs: _References) -> Callable[..., nn.Module]:
    """``fn``, checking that what it returns is a ``torch.nn.Module``."""

    @functools.wraps(fn)
    def build(*args: Any, **kwargs: Any) -> nn.Module:
        model = fn(*args, **kwargs)
        if not isinstance(model, nn.Module):
            raise refs.error(
                "model.type",
                f"{describe(fn)} returned {describe(model)}; model.type must give a torch.nn.Module",
            )
        return model

    return build


def _data_slots(config: Config, refs: _References) -> tuple[Callable[..., Any], dict[str, Any]]:
    """``data.build`` (a function of the user's returning the datasets) and ``data.kwargs``."""
    build = refs.ref(config.data.build, "data", "data.build")
    kwargs = refs.tree(config.data.kwargs, "data.kwargs")
    refs.bind(
        build,
        type_key="data.build",
        kwargs_key="data.kwargs",
        kwargs=kwargs,
        supplied={"seed": 0},
        how="(seed, ...)",
    )
    return build, kwargs


def _hook_slots(config: Config, refs: _References) -> Callable[[Any], Any] | None:
    """``hooks.after_training``: a function of the user's, called with the run's context, or None."""
    hook = config.hooks.after_training
    if hook is None:
        return None
    fn = refs.ref(hook, "hook", "hooks.after_training")
    refs.bind(fn, type_key="hooks.after_training", kwargs_key="hooks.after_training", kwargs={}, args=(None,))
    return fn


# -- preflight: what resolve() cannot see without building ------------------------------------


def _check_device(config: Config, refs: _References) -> None:
    """``training.device``: a device this machine has (each rank still takes its own)."""
    text = config.training.device
    if text is None:
        return
    key = "training.device"
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as err:
        raise refs.error(
            key, f"{text!r} is not a device ({err}); use 'cpu' or 'cuda', or leave it out"
        ) from None
    if device.type == "cpu":
        return
    backend = getattr(torch, device.type, None)
    available = bool(getattr(backend, "is_available", lambda: False)())
    if not available:
        raise refs.error(
            key,
            f"{text!r} asks for {device.type}, which this machine does not have; leave training.device out "
            "(each rank takes its own device) or set it to 'cpu'",
        )
    count = int(getattr(backend, "device_count", lambda: 0)())
    if device.index is not None and device.index >= count:
        raise refs.error(
            key,
            f"{text!r}: this machine has {count} {device.type} device(s) (0..{count - 1}); leave "
            "training.device out (each rank takes its own device)",
        )


def _check_output_root(config: Config, refs: _References) -> None:
    """The run folder ``<root>/<name>`` can be made: its nearest existing parent is a writable folder."""
    key = "training.path" if config.training.path else "logging.root"
    root = Path(config.training.path or config.logging.root)
    probe = root / config.name
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise refs.error(key, f"{probe} is a file, not a folder: runs cannot be written under {root}")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise refs.error(key, f"{probe} is not writable here: runs cannot be written under {root}")


def _meta_only(err: BaseException) -> bool:
    """Whether ``err`` comes from the meta device itself (a real device would not raise it)."""
    return isinstance(err, NotImplementedError) or "meta" in str(err).lower()


def _meta_model(resolved: Resolved, refs: _References) -> nn.Module | None:
    """The model built on the ``meta`` device; None when it cannot be built there."""
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return resolved.model_type(**resolved.model_kwargs)
    except ConfigError:
        raise
    except Exception as err:
        if _meta_only(err):
            _log.debug("the model cannot be built on the meta device (%s); not checked before spawn", err)
            return None
        raise refs.error(
            "model.kwargs" if resolved.model_kwargs else "model.type",
            f"building the model ({describe(resolved.model_type)}) raised {type(err).__name__}: {err}",
        ) from err


def _meta_optimizer(config: Config, resolved: Resolved, model: nn.Module, refs: _References) -> None:
    """The optimizer on the meta model's parameters, and the scheduler on that optimizer."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise refs.error(
            "model.type", f"{describe(resolved.model_type)} built a model with no trainable parameters"
        )
    kwargs = dict(resolved.optimizer_kwargs)
    if config.training.lr is not None:
        kwargs["lr"] = config.training.lr
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizer = resolved.optimizer_type(params, **kwargs)
    except Exception as err:
        if _meta_only(err) or {"fused", "foreach", "capturable"} & set(kwargs):
            return
        raise refs.error(
            "training.optimizer_kwargs" if kwargs else "training.optimizer_type",
            f"building {describe(resolved.optimizer_type)} raised {type(err).__name__}: {err}",
        ) from err
    if resolved.scheduler_type is None:
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            resolved.scheduler_type(optimizer, **resolved.scheduler_kwargs)
    except Exception as err:
        if _meta_only(err):
            return
        raise refs.error(
            "training.scheduler_kwargs" if resolved.scheduler_kwargs else "training.scheduler_type",
            f"building {describe(resolved.scheduler_type)} raised {type(err).__name__}: {err}",
        ) from err
