"""A sweep's plan, checked whole before any trial starts: Optuna's classes and the search space.

:func:`plan_sweep` reads the config and checks what :mod:`unison.config.tuning` could not
without Optuna: ``tuning.sampler`` and ``tuning.pruner`` name classes of
``optuna.samplers`` and ``optuna.pruners`` (nothing else: the config's typed-slot rule),
their keyword arguments bind, and each value the search space can draw (its bounds, each
choice) makes a config that validates, plans and passes the preflight of ``unison run``.
"""

from __future__ import annotations

import difflib
import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from unison.config import Config, ConfigError, load_config
from unison.config.schema import TuningConfig
from unison.config.tuning import check_storage_confined
from unison.recipe.build.preflight import preflight
from unison.recipe.planning.dead_keys import changes_nothing
from unison.recipe.planning.references import _References
from unison.recipe.planning.run_plan import plan as plan_run

EXTRA = "pip install 'unison[tune]'"
"""How to install what ``unison tune`` needs (Optuna)."""


class MissingOptunaError(ImportError):
    """``unison tune`` without Optuna installed; the message names the extra."""


def import_optuna() -> ModuleType:
    """The ``optuna`` module, or a :class:`MissingOptunaError` naming the extra to install."""
    try:
        import optuna
    except ImportError as err:
        raise MissingOptunaError(
            f"unison tune needs Optuna, an optional extra: {EXTRA} (or pip install optuna). "
            f"Importing it failed: {err}"
        ) from err
    return optuna


def optuna_object(tuning: TuningConfig, refs: _References, key: str, seed_offset: int = 0) -> Any:
    """Builds ``tuning.<key>`` (``sampler`` or ``pruner``) from Optuna's own classes only.

    The name is looked up in ``optuna.samplers.__all__`` or ``optuna.pruners.__all__``;
    abstract bases are refused; the kwargs are bound to the class's signature first.
    ``seed_offset`` is added to a sampler's ``seed`` (a resumed study must not draw its
    first trials' values again).
    """
    optuna = import_optuna()
    t = tuning
    name = t.sampler if key == "sampler" else (t.pruner or "NopPruner")
    kwargs = dict(t.sampler_kwargs if key == "sampler" else t.pruner_kwargs)
    module = optuna.samplers if key == "sampler" else optuna.pruners
    base = optuna.samplers.BaseSampler if key == "sampler" else optuna.pruners.BasePruner

    def usable(n: str) -> bool:
        obj = getattr(module, n, None)
        return (
            isinstance(obj, type)
            and issubclass(obj, base)
            and not inspect.isabstract(obj)
            and obj is not base
        )

    exported = [n for n in getattr(module, "__all__", []) if usable(n)]
    if name not in exported:
        near = difflib.get_close_matches(name, exported, n=1, cutoff=0.5)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise refs.error(
            f"tuning.{key}",
            f"{name!r} is not one of {module.__name__}'s classes: {', '.join(sorted(exported))}.{hint}",
        )
    cls = getattr(module, name)
    refs.bind(cls, type_key=f"tuning.{key}", kwargs_key=f"tuning.{key}_kwargs", kwargs=kwargs)
    if seed_offset and isinstance(kwargs.get("seed"), int):
        kwargs["seed"] += seed_offset
    try:
        return cls(**kwargs)
    except Exception as err:
        raise refs.error(
            f"tuning.{key}_kwargs", f"{name}(**{kwargs}) raised {type(err).__name__}: {err}"
        ) from None


def suggest(trial: Any, key: str, spec: dict[str, Any]) -> Any:
    """Draws the value of config key ``key`` for ``trial`` (an ``optuna.Trial``) as ``spec`` says."""
    kind = spec["type"]
    if kind == "categorical":
        return trial.suggest_categorical(key, spec["choices"])
    log = bool(spec.get("log", False))
    if kind == "int":
        return trial.suggest_int(key, spec["low"], spec["high"], step=spec.get("step") or 1, log=log)
    return trial.suggest_float(key, float(spec["low"]), float(spec["high"]), step=spec.get("step"), log=log)


def as_overrides(params: dict[str, Any]) -> list[str]:
    """Drawn values as ``--set`` items (``training.lr=0.0003``), each value as JSON (a YAML subset)."""
    return [f"{key}={json.dumps(value)}" for key, value in params.items()]


def _examples(spec: dict[str, Any]) -> list[Any]:
    if spec["type"] == "categorical":
        return list(spec["choices"])
    cast = int if spec["type"] == "int" else float
    return [cast(spec["low"]), cast(spec["high"])]


@dataclass
class SweepPlan:
    """A checked sweep: the config, where its trials and study go, what they are judged by."""

    path: str
    overrides: list[str]
    config: Config
    folder: Path
    storage: str
    study_name: str
    metric: str
    direction: str
    space: dict[str, dict[str, Any]]
    root: Path
    """The output root (``training.path`` or ``logging.root``), absolute: a study's file is inside it."""
    refs: _References
    """The config's locator for errors: the run's plan's (built once)."""


def check_space(plan: SweepPlan, trains_here: bool = False) -> None:
    """Each value the search space can draw (bounds, each choice) makes a config ``unison run``
    accepts: validated, planned, and checked by its preflight (the model built on ``meta``, unless
    the trials train in this process: ``trains_here``); and each key changes the run
    (:func:`~unison.recipe.planning.dead_keys.changes_nothing`), the rule by which a run refuses arguments of
    an object it does not build."""
    for key, spec in plan.space.items():
        why = changes_nothing(plan.config, key)
        if why is not None:
            raise plan.refs.origin.error(
                ("tuning", "search_space", key),
                f"{key} changes nothing: {why}; every trial would train alike. Set what it needs, or "
                "remove it from the search space",
            )
        for value in _examples(spec):
            try:
                drawn = load_config(plan.path, [*plan.overrides, *as_overrides({key: value})])
                preflight(plan_run(drawn), trains_here=trains_here)
            except ConfigError as err:
                raise plan.refs.origin.error(
                    ("tuning", "search_space", key),
                    f"the search space can draw {key} = {value!r}, and a run refuses that config: {err}. Narrow "
                    "the range (or the choices) to values the run takes",
                ) from None


def plan_sweep(path: str | os.PathLike[str], overrides: list[str], nproc: int | None = None) -> SweepPlan:
    """Reads and checks everything a sweep needs, before any process is spawned.

    ``nproc``: the ranks of each trial (``--nproc``, else ``parallel.nproc_per_node``); with
    neither, the trials train in this process, which the checks then leave as they found it
    (:func:`~unison.recipe.build.preflight.preflight`'s ``trains_here``).

    Raises:
        ConfigError: naming the file, the line and the key of the first problem.
        MissingOptunaError: when Optuna is not installed.
    """
    config = load_config(path, overrides)
    t = config.tuning
    if t.metric is None or not t.search_space:  # tuning.metric is filled when the section is there
        raise config.origin.error(
            ("tuning", "search_space"),
            "nothing to tune: add a tuning section with a search space, e.g.\n"
            "tuning:\n  search_space:\n    training.lr: {type: float, low: 1.0e-4, high: 1.0e-1, log: true}\n"
            "(see docs/tuning.md)",
        )
    run = plan_run(config)
    optuna_object(t, run.refs, "sampler")  # the run's locator, for the sweep's own keys too
    optuna_object(t, run.refs, "pruner")
    trains_here = (nproc if nproc is not None else config.parallel.nproc_per_node) is None
    preflight(run, trains_here=trains_here)
    study_name = t.study_name or config.name
    root, folder = run.root.resolve(), run.run_root / f"tune-{study_name}"
    check_storage_confined(config, root)  # once, here: the trials take the checked value
    storage = (t.storage or "").strip() or f"sqlite:///{folder.resolve() / 'study.db'}"
    plan = SweepPlan(
        str(path), list(overrides), config, folder, storage, study_name, t.metric, str(t.direction),
        {str(k): v for k, v in t.search_space.items()}, root, run.refs,
    )  # fmt: skip
    check_space(plan, trains_here)
    return plan
