"""Early stopping as a config's ``early_stopping`` section asks for it.

The section's ``type`` names the handler class: left out (or ``EarlyStopping``, or
QuantumGrav's ``DefaultEarlyStopping``) it is :class:`unison.handlers.EarlyStopping`; a
name found in the modules under ``imports:`` or a ``!pyobject`` names a subclass of it
(:func:`unison.config.names.resolve_name`, slot ``early_stopping``). The handler is built
as ``type(trainer, *args, metric=..., patience=..., mode=..., ..., **kwargs)``: the
section's keys (which :func:`unison.config.compat.apply_compat` filled from QuantumGrav's
``kwargs``), then what ``kwargs`` holds besides them. :func:`early_stopping_slot` checks
that call against the class's signature; :func:`early_stopping_plan` turns it, once, into the
:class:`EarlyStoppingPlan` the run's plan holds; :func:`make_early_stopping` makes the handler
from it on every rank.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from ignite.engine import Engine

from unison.config import Config, PyObjectRef, resolve_tree
from unison.config.compat import EARLY_STOPPING_NAMES
from unison.config.names import resolve_name
from unison.config.watched import Watched, watched_of
from unison.handlers import EarlyStopping
from unison.recipe.planning.references import _References

KEY = "early_stopping.type"


def _handler_class(config: Config, refs: _References) -> type[EarlyStopping]:
    value = config.early_stopping.type
    if value is None:
        return EarlyStopping
    if isinstance(value, PyObjectRef):
        return refs.ref(value, "early_stopping", KEY)
    return resolve_name(
        value,
        slot="early_stopping",
        key=KEY,
        scope=refs.scope,
        known=EARLY_STOPPING_NAMES,
        fail=lambda message: refs.error(KEY, message),
    )


@dataclass(frozen=True)
class EarlyStoppingPlan:
    """The handler a run builds: ``cls(trainer, *args, **kwargs)``, resolved and bound once."""

    cls: type[EarlyStopping]
    args: list[Any]
    kwargs: dict[str, Any]
    section: frozenset[str] = frozenset()
    """The names in ``kwargs`` that come from the section's own keys (the rest from its ``kwargs``)."""


def section_kwargs(config: Config, watched: Watched) -> dict[str, Any]:
    """The handler's keyword arguments from the section's keys, its metric and mode as ``watched`` says."""
    es = config.early_stopping
    return {
        "metric": watched.stop_metric,
        "patience": es.patience,
        "mode": watched.stop_mode,
        "min_delta": es.min_delta,
        "threshold_mode": es.threshold_mode,
        "cumulative_delta": es.cumulative_delta,
        "agreement": es.agreement,
    }


def _positional_names(cls: type, args: list[Any]) -> set[str]:
    """The parameters that ``args`` (after the trainer) fill, by name."""
    try:
        bound = inspect.signature(cls).bind_partial(None, *args)
    except (TypeError, ValueError):
        return set()
    return set(list(bound.arguments)[1:])


def early_stopping_slot(
    config: Config, refs: _References, watched: Watched | None = None
) -> tuple[type[EarlyStopping], list[Any], dict[str, Any]] | None:
    """The handler class, its positional ``args`` and its other ``kwargs``; None without ``patience``.

    Checks, before any rank starts, that the class is unison's ``EarlyStopping`` or a subclass
    of it and that ``type(trainer, *args, <section keys>, **kwargs)`` binds to its signature.

    Raises:
        ConfigError: at ``early_stopping.type``, ``.args`` or ``.kwargs``, with what the class takes.
    """
    plan = early_stopping_plan(config, refs, watched or watched_of(config))
    if plan is None:
        return None
    return plan.cls, plan.args, {k: v for k, v in plan.kwargs.items() if k not in plan.section}


def early_stopping_plan(config: Config, refs: _References, watched: Watched) -> EarlyStoppingPlan | None:
    """The checked handler of the section (:func:`early_stopping_slot`'s checks), with every keyword
    it is built with; None without ``patience``.

    Raises:
        ConfigError: at ``early_stopping.type``, ``.args`` or ``.kwargs``, with what the class takes.
    """
    es = config.early_stopping
    if es.patience is None:
        return None
    cls = _handler_class(config, refs)
    scope = refs.scope
    args = list(
        resolve_tree(es.args, key="early_stopping.args", imports=scope.imports, config_dir=scope.config_dir)
    )
    extra = refs.tree(es.kwargs, "early_stopping.kwargs")
    given = section_kwargs(config, watched)
    for name in _positional_names(cls, args):
        given.pop(name, None)
    refs.bind(
        cls,
        type_key=KEY,
        kwargs_key="early_stopping.kwargs",
        kwargs=extra,
        args=(None, *args),
        supplied=given,
        how=" (trainer, metric, patience=..., and the section's other keys)",
    )
    return EarlyStoppingPlan(cls, args, {**given, **extra}, frozenset(given))


def make_early_stopping(plan: EarlyStoppingPlan | None, trainer: Engine) -> EarlyStopping | None:
    """The early stopping handler ``plan`` describes, for ``trainer``; None without one.

    Distributed:
        Build it on every rank (and attach it to the evaluator on every rank).
    """
    if plan is None:
        return None
    build: Any = plan.cls  # a subclass may take positional arguments of its own (args)
    stopper: EarlyStopping = build(trainer, *plan.args, **plan.kwargs)
    return stopper
