"""``logging.wandb`` in a run and a sweep: the check before spawning, the logger, the trials' keys.

- :func:`~unison.recipe.planning.wandb_plan.check_wandb` (the plan's check): W&B is installed,
  the names given are not empty, ``every`` has sync points to use;
- :func:`attach_wandb`, on every rank: a :class:`~unison.handlers.wandb.WandbLogger` with the
  plan's settings (:mod:`unison.recipe.planning.wandb_plan`), writing under ``<run>/wandb`` and
  recording its run in ``<run>/wandb-run.json`` (continued by ``--resume``); only rank 0 opens
  a W&B run;
- :func:`wandb_trial_overrides`: a sweep's trials in the sweep's project, grouped under it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from unison.config import Config
from unison.handlers.wandb import WandbLogger
from unison.handlers.wandb_writer import Checkpoint
from unison.recipe.build.parts import RunParts
from unison.recipe.planning.run_plan import RunPlan
from unison.recipe.planning.wandb_plan import check_wandb as check_wandb

RUN_FILE = "wandb-run.json"
"""In a run folder: the W&B run it writes to (id, project, entity), continued on resume."""


def newest_checkpoint(parts: RunParts) -> Checkpoint | None:
    """The newest checkpoint of the run (a file, or a sharded checkpoint's folder) and its
    manifest entry; None when there is none."""
    checkpoint = parts.checkpoint
    newest = [] if checkpoint is None else checkpoint.manifest.newest()
    if checkpoint is None or not newest:
        return None
    entry = newest[0]
    fields = {k: v for k, v in dataclasses.asdict(entry).items() if isinstance(v, (int, float, str))}
    return checkpoint.folder / entry.file, fields


def attach_wandb(plan: RunPlan, parts: RunParts, run_dir: Path) -> WandbLogger | None:
    """``logging.wandb``: builds and attaches the W&B logger; None when it is off.

    Distributed:
        Every rank builds and attaches it alike (it joins the trainer's sync point with
        ``every``); only rank 0 opens a W&B run, at the trainer's ``STARTED``.
    """
    w = plan.logging.wandb
    if w is None:
        return None
    logger = WandbLogger(
        w.project,
        trainer=parts.trainer,
        evaluators={"val": parts.evaluator},
        entity=w.entity,
        name=w.name or run_dir.name,
        group=w.group,
        tags=w.tags,
        mode=w.mode,
        config=w.config,
        every=w.every,
        directory=run_dir,
        run_file=run_dir / RUN_FILE,
        checkpoint=(lambda: newest_checkpoint(parts)) if w.log_checkpoints else None,
    )
    logger.attach(parts.trainer)
    return logger


def wandb_trial_overrides(config: Config, study_name: str, number: int) -> list[str]:
    """``--set`` keys for trial ``number`` of a sweep with ``logging.wandb``: the sweep's project
    (the config's name, as the trial's own name is ``trial-NNNN``), the run named after the
    trial, grouped under the sweep (``tune-<study>``). Empty without ``logging.wandb``."""
    w = config.logging.wandb
    if w is None:
        return []
    values = {
        "project": w.project or config.name,
        "name": f"trial-{number:04d}",
        "group": w.group or f"tune-{study_name}",
    }
    return [f"logging.wandb.{key}={json.dumps(value)}" for key, value in values.items()]
