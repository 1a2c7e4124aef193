"""Importing and type-checking what a config names, before any rank is spawned.

:func:`resolve` imports every ``!pyobject`` of a config into a :class:`Resolved`, one slot
family at a time (metrics and the metric that checkpoints and early stopping watch,
optimizer, scheduler, loss, model, data, hooks). Each object is checked against its typed
slot (:data:`unison.config.resolve.SLOTS`) before anything is called, and every kwargs
mapping is bound against the signature it will be called with
(:mod:`unison.recipe.planning.references`). :func:`unison.recipe.plan` adds what a run derives
(the early-stopping handler among it); :func:`unison.recipe.build.preflight.preflight` then builds
the model on the ``meta`` device and checks the run. :func:`make_metrics` and
:func:`scaled_lr` turn what :func:`resolve` found into the objects and numbers a run uses.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from unison.config import Config, ConfigError, PyObjectRef, resolve_tree
from unison.config.batch_sizes import asks_world_size
from unison.config.data_config import uses_files
from unison.config.names import resolve_name
from unison.config.usercode import describe
from unison.metrics import Loss
from unison.recipe.planning.batch import BatchSlots, batch_slots, criterion_loss, with_loss
from unison.recipe.planning.dead_keys import unowned
from unison.recipe.planning.file_data import file_data_slots
from unison.recipe.planning.references import _References
from unison.recipe.planning.stream_files import stream_data_slots


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
    optimizer_args: list[Any] = field(default_factory=list)
    """Positional arguments of the optimizer after the parameters (``training.optimizer_args``)."""
    model_args: list[Any] = field(default_factory=list)
    """Positional arguments of the model (``model.args``)."""
    batches: BatchSlots = field(default_factory=BatchSlots)
    """Collate, batch preparation, model calls and evaluation criteria (:mod:`unison.recipe.planning.batch`)."""


def resolve(config: Config, refs: _References | None = None) -> Resolved:
    """Imports every ``!pyobject`` of ``config``, checks its slot, and binds its kwargs.

    Modules beside the config are imported by file path (``sys.path`` is left alone);
    ``imports:`` is checked to name the user's own modules only. The slot families go in
    a fixed order: metrics (and the metric that checkpoints and early stopping watch),
    optimizer, scheduler, loss, model, data, hooks. Nothing the config names is called,
    except a loss given as a ``torch.nn.Module`` class, which is built with no arguments.

    Raises:
        ConfigError: for the first reference that is refused, missing or of the wrong kind,
            kwargs that do not fit the signature they will be called with, or kwargs given for
            an object the config does not build (:func:`~unison.recipe.planning.dead_keys.unowned`).
    """
    refs = refs if refs is not None else _References.of(config)  # a plan passes its own (built once there)
    dead = unowned(config)  # scheduler_kwargs without scheduler_type: read by nothing
    if dead is not None:
        raise refs.error(*dead)
    found: dict[str, Any] = {}
    for names, resolver in FAMILIES:
        found.update(zip(names, resolver(config, refs, found), strict=True))
    return Resolved(**found)


def _watched(config: Config, refs: _References, found: dict[str, Any]) -> tuple[()]:
    """The metric that checkpoints and early stopping watch is one the validation reports."""
    metrics = found["metrics"]
    own_loss = (
        "criterion" in config.validation.validator
    )  # QuantumGrav's: the validation loss, always reported
    _check_watched_metrics(config, [*metrics, *(["loss"] if own_loss or not metrics else [])], refs)
    return ()


Resolver = Callable[[Config, _References, dict[str, Any]], tuple[Any, ...]]
"""One slot family: ``(config, refs, found)`` -> its values, in the order of its field names
(``found``: what the families before it resolved, by :class:`Resolved` field)."""

FAMILIES: tuple[tuple[tuple[str, ...], Resolver], ...] = (
    (("metrics",), lambda c, r, found: (_metric_slots(c, r),)),
    ((), _watched),
    (("optimizer_type", "optimizer_kwargs", "optimizer_args"), lambda c, r, found: _optimizer_slots(c, r)),
    (("scheduler_type", "scheduler_kwargs"), lambda c, r, found: _scheduler_slots(c, r)),
    (("loss",), lambda c, r, found: (_loss_slot(c, r),)),
    (("model_type", "model_args", "model_kwargs"), lambda c, r, found: _model_slots(c, r)),
    (("data_build", "data_kwargs"), lambda c, r, found: _data_slots(c, r)),
    (("batches",), lambda c, r, found: (batch_slots(c, r, found["loss"]),)),
    (("after_training",), lambda c, r, found: (_hook_slots(c, r),)),
)
"""The slot families :func:`resolve` takes in this order, each with the :class:`Resolved` fields it
fills: the first reference refused stops the pass, so the order decides which error a config meets."""


MetricSpec = tuple[type, dict[str, Any]]
"""A metric an evaluation builds: its class and keyword arguments, the loss rule applied."""


def metric_specs(resolved: Resolved, section: str = "validation") -> dict[str, MetricSpec]:
    """The metrics of an evaluation of ``section`` (``validation`` or ``testing``), the loss rule
    applied: a ``Loss`` without ``loss_fn`` uses the section's criterion, else the training loss. A
    section with its own criterion (QuantumGrav's ``validator.criterion`` / ``tester.criterion``)
    reports it as ``loss`` beside the metrics named, unless one of them is a ``Loss`` already;
    without metrics, the loss alone. The plan computes it once per section (``RunPlan.metrics``)."""
    own = resolved.batches.losses.get(section)
    loss = own or resolved.loss
    specs = {name: (cls, with_loss(cls, kwargs, loss)) for name, (cls, kwargs) in resolved.metrics.items()}
    if own is not None and "loss" not in specs and not any(issubclass(c, Loss) for c, _ in specs.values()):
        specs["loss"] = (Loss, {"loss_fn": own})
    return specs or {"loss": (Loss, {"loss_fn": loss})}


def build_metrics(specs: dict[str, MetricSpec]) -> dict[str, Any]:
    """Fresh metric objects of ``specs`` (what :func:`metric_specs` planned), one per name."""
    return {name: cls(**kwargs) for name, (cls, kwargs) in specs.items()}


def make_metrics(resolved: Resolved, section: str = "validation") -> dict[str, Any]:
    """Fresh metric objects for an evaluation of ``section``: :func:`metric_specs`, built."""
    return build_metrics(metric_specs(resolved, section))


def scaled_lr(base: float, rule: str, world_size: int) -> float:
    """The learning rate after the scaling rule: ``none``, ``linear`` or ``sqrt`` in the world size."""
    if rule == "linear":
        return base * world_size
    if rule == "sqrt":
        return base * math.sqrt(world_size)
    return base


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
    supplied = {k: v for k, v in with_loss(cls, kwargs, None).items() if k not in kwargs}
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


def _optimizer_slots(config: Config, refs: _References) -> tuple[type, dict[str, Any], list[Any]]:
    """``training.optimizer_type`` (an optimizer class), ``optimizer_kwargs`` and ``optimizer_args``."""
    t = config.training
    cls = refs.ref(t.optimizer_type, "optimizer", "training.optimizer_type")
    kwargs = refs.tree(t.optimizer_kwargs, "training.optimizer_kwargs")
    scope = refs.scope
    args = list(
        resolve_tree(
            t.optimizer_args,
            key="training.optimizer_args",
            imports=scope.imports,
            config_dir=scope.config_dir,
        )
    )
    refs.bind(
        cls,
        type_key="training.optimizer_type",
        kwargs_key="training.optimizer_kwargs",
        kwargs={**kwargs, **({"lr": t.lr} if t.lr is not None else {})},
        args=([], *args),
        how=f"(params, *{args!r}, ...)" if args else "(params, ...)",
    )
    return cls, kwargs, args


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
    key = "criterion" if config.criterion is not None else "training.loss"
    loss = refs.ref(config.criterion or config.training.loss, "loss", key)
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
        loss = loss()
    if key == "criterion":  # QuantumGrav's name: a function of the user's gets the whole batch
        return criterion_loss(loss, refs)
    if not isinstance(loss, nn.Module):
        try:
            refs.bind(
                loss, type_key=key, kwargs_key=key, kwargs={}, args=(None, None), how="(output, target)"
            )
        except ConfigError as err:
            raise refs.error(
                key,
                f"{describe(loss)} cannot be called as {key.split('.')[-1]}(y_pred, y), with the model's output "
                f"and the batch's target ({err.problem}). A loss of the model's output and the whole batch "
                "(QuantumGrav's compute_loss(outputs, data, trainer)) is named by the top-level `criterion` "
                "key instead; otherwise give any other parameter a default",
            ) from None
    return loss


def _model_slots(
    config: Config, refs: _References
) -> tuple[Callable[..., nn.Module], list[Any], dict[str, Any]]:
    """``model.type`` (a model class, or a function of the user's returning one), ``model.args`` and
    ``model.kwargs``; with ``model.from_config``, a builder calling ``type.from_config(model.config)``."""
    named = config.model.type
    if isinstance(named, str):
        model_type = resolve_name(
            named,
            slot="model",
            key="model.type",
            scope=refs.scope,
            fail=lambda m: refs.error("model.type", m),
        )
    else:
        model_type = refs.ref(named, "model", "model.type")
    m, scope = config.model, refs.scope

    def parts(value: Any, key: str) -> Any:  # layer classes and nn functions of libraries too
        return resolve_tree(
            value, key=key, imports=scope.imports, config_dir=scope.config_dir, slot="model_arg"
        )

    if m.from_config:
        return _from_config(model_type, parts(m.config, "model.config"), refs), [], {}
    args, kwargs = list(parts(m.args, "model.args")), refs.tree(m.kwargs, "model.kwargs", slot="model_arg")
    refs.bind(
        model_type,
        type_key="model.type",
        kwargs_key="model.kwargs",
        kwargs=kwargs,
        args=tuple(args),
        how=f"(*{m.args!r}, ...)" if args else "",
    )
    if isinstance(model_type, type):
        return model_type, args, kwargs
    return _checked_factory(model_type, refs), args, kwargs


def _from_config(cls: Any, nested: dict[str, Any], refs: _References) -> Callable[..., nn.Module]:
    """A builder of ``cls.from_config(nested)``: QuantumGrav's way of building a model from nested keys."""
    build = getattr(cls, "from_config", None)
    if not isinstance(cls, type) or not callable(build):
        raise refs.error(
            "model.from_config",
            f"{describe(cls)} has no from_config classmethod to build the model from model.config; name the "
            "class that has one, or set from_config: false and give args and kwargs",
        )
    refs.bind(
        build,
        type_key="model.type",
        kwargs_key="model.config",
        kwargs={},
        args=(nested,),
        how=".from_config(config)",
    )
    return _checked_factory(functools.partial(build, nested), refs)


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
    """``data.build`` (a function of the user's returning the datasets) and ``data.kwargs``; with
    ``data.files``, the file-backed dataset that takes its place (:mod:`unison.recipe.planning.file_data`); with
    ``data.stream``, the stream's (:mod:`unison.recipe.planning.stream_files`)."""
    if config.data.stream is not None:
        return stream_data_slots(config, refs), {}
    if uses_files(config.data):
        return file_data_slots(config, refs), {}
    build = refs.ref(config.data.build, "data", "data.build")
    kwargs = refs.tree(config.data.kwargs, "data.kwargs")
    told = asks_world_size(build)  # a parameter named world_size: the run gives it
    if told and "world_size" in kwargs:
        raise refs.error(
            "data.kwargs.world_size",
            f"{describe(build)} takes world_size, which is given by the run (its number of ranks, on every "
            "rank); a fixed value would be wrong at another --nproc. Remove it from data.kwargs",
        )
    refs.bind(
        build,
        type_key="data.build",
        kwargs_key="data.kwargs",
        kwargs=kwargs,
        supplied={"seed": 0, **({"world_size": 1} if told else {})},
        how="(seed, world_size, ...)" if told else "(seed, ...)",
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
