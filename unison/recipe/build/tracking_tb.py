"""A run's TensorBoard extras: its settings for the HParams dashboard, and profiler traces.

- :func:`attach_hparams`: with ``logging.tensorboard``, rank 0 writes the config's settings
  (:func:`~unison.recipe.planning.config_record.hparams_of`, in the plan) as an HParams session into ``<run>/tb`` when the run ends
  (:class:`~unison.handlers.hparams.HParamsLogger`);
- :func:`attach_profiler`: with ``training.profile``, every rank records a ``torch.profiler``
  trace of a few iterations into ``<run>/tb/plugins/profile/``
  (:class:`~unison.handlers.profiler.Profiler`);
- :func:`profile_overrides`: what ``unison run --profile [ACTIVE]`` sets.
"""

from __future__ import annotations

import os
from pathlib import Path

from unison.config import ConfigError
from unison.config.loader import load_yaml
from unison.handlers.hparams import HParamsLogger
from unison.handlers.profiler import Profiler
from unison.recipe.build.parts import RunParts
from unison.recipe.planning.config_record import LEFT_OUT as LEFT_OUT
from unison.recipe.planning.config_record import hparams_of as hparams_of
from unison.recipe.planning.run_plan import RunPlan


def attach_hparams(plan: RunPlan, parts: RunParts, run_dir: Path) -> HParamsLogger | None:
    """With ``logging.tensorboard``, the run's settings to ``run_dir/tb`` for the HParams dashboard.

    Its metric columns are the last values of the run's scalars there (``train/loss``,
    ``val/<metric>``), which the run's :class:`~unison.handlers.TensorBoardLogger` writes.

    Distributed:
        Every rank attaches it; rank 0 writes.
    """
    hparams = plan.logging.hparams
    if hparams is None:
        return None
    logger = HParamsLogger(run_dir / "tb", hparams, trainer=parts.trainer)
    logger.attach()
    return logger


def attach_profiler(plan: RunPlan, parts: RunParts, run_dir: Path) -> Profiler | None:
    """With ``training.profile``, a trace of its window of iterations on every rank, into
    ``run_dir/tb/plugins/profile/iterations-<first>-<last>/rank<R>.<ns>.pt.trace.json``.

    Distributed:
        Every rank attaches it and writes its own trace.
    """
    window = plan.logging.profile
    if window is None:
        return None
    profiler = Profiler(run_dir / "tb", **window)
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
