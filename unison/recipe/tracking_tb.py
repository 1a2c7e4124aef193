"""A run's TensorBoard extras: its settings for the HParams dashboard, and profiler traces.

- :func:`attach_hparams`: with ``logging.tensorboard``, rank 0 writes the config's settings
  (:func:`hparams_of`) as an HParams session into ``<run>/tb`` when the run ends
  (:class:`~unison.handlers.hparams.HParamsLogger`);
- :func:`attach_profiler`: with ``training.profile``, every rank records a ``torch.profiler``
  trace of a few iterations into ``<run>/tb/plugins/profile/``
  (:class:`~unison.handlers.profiler.Profiler`);
- :func:`profile_overrides`: what ``unison run --profile [ACTIVE]`` sets.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from unison.config import Config, ConfigError
from unison.config.loader import PyObjectRef, load_yaml
from unison.handlers.hparams import HParamsLogger, HParamValue
from unison.handlers.profiler import Profiler
from unison.recipe.parts import RunParts
from unison.recipe.planning import RunPlan

LEFT_OUT = ("tuning",)
"""Sections not written as hparams: ``tuning`` describes a sweep, the same for all its trials."""


def hparams_of(config: Config) -> dict[str, HParamValue]:
    """The config's settings as flat ``section.key`` names: what the HParams dashboard shows.

    Numbers, booleans and strings are kept; a ``!pyobject`` reference is its dotted path;
    mappings (``optimizer_kwargs``, ``model.kwargs``, sections) are flattened into dotted
    names; lists, empty mappings, ``None`` and the sections of :data:`LEFT_OUT` are left out.

    Example:
        >>> from unison.config import Config
        >>> hp = hparams_of(Config())
        >>> hp["training.lr_scaling"], hp["training.optimizer_type"], "training.lr" in hp
        ('none', 'torch.optim.AdamW', False)
    """
    flat: dict[str, HParamValue] = {}

    def walk(value: Any, name: str) -> None:
        if isinstance(value, PyObjectRef):
            flat[name] = value.path
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name), f"{name}.{f.name}" if name else f.name)
        elif isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, f"{name}.{key}")
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value

    for f in dataclasses.fields(config):
        if f.name not in LEFT_OUT:
            walk(getattr(config, f.name), f.name)
    return flat


def attach_hparams(plan: RunPlan, parts: RunParts, run_dir: Path) -> HParamsLogger | None:
    """With ``logging.tensorboard``, the run's settings to ``run_dir/tb`` for the HParams dashboard.

    Its metric columns are the last values of the run's scalars there (``train/loss``,
    ``val/<metric>``), which the run's :class:`~unison.handlers.TensorBoardLogger` writes.

    Distributed:
        Every rank attaches it; rank 0 writes.
    """
    if not plan.config.logging.tensorboard:
        return None
    logger = HParamsLogger(run_dir / "tb", hparams_of(plan.config), trainer=parts.trainer)
    logger.attach()
    return logger


def attach_profiler(plan: RunPlan, parts: RunParts, run_dir: Path) -> Profiler | None:
    """With ``training.profile``, a trace of its window of iterations on every rank, into
    ``run_dir/tb/plugins/profile/iterations-<first>-<last>/rank<R>.<ns>.pt.trace.json``.

    Distributed:
        Every rank attaches it and writes its own trace.
    """
    window = plan.config.training.profile
    if window is None:
        return None
    profiler = Profiler(run_dir / "tb", **dataclasses.asdict(window))
    profiler.attach(parts.trainer)
    return profiler


def profile_overrides(config_path: str | os.PathLike[str], active: int | None) -> list[str]:
    """The ``--set`` items of ``unison run --profile [ACTIVE]``.

    ``--profile ACTIVE`` sets ``training.profile.active``; a bare ``--profile`` turns the
    profiler on with the config's own ``training.profile`` when it has one, else with the
    defaults. A config that cannot be read is left to the loader, which names the problem.
    """
    if active is not None:
        return [f"training.profile.active={active}"]
    try:
        training = load_yaml(config_path).data.get("training")
    except ConfigError:
        return ["training.profile={}"]
    if isinstance(training, dict) and isinstance(training.get("profile"), dict):
        return []
    return ["training.profile={}"]
