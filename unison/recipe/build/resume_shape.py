"""A resume the saved checkpoint cannot continue, refused before any rank starts, naming the key.

:func:`check_resume_shape` reads the checkpoint a resume would load (its ``meta``, the config
it was saved with, whether it holds the data's own state) and this run's plan:

- ``OneCycleLR`` stepped once per optimizer update (``training.scheduler_every: update``) counts
  its ``total_steps`` in updates, and an epoch takes another number of updates at another world
  size: at fewer ranks the schedule runs past its last step and torch fails mid-epoch ("Tried to
  step ... times"), at more it ends before its final annealing. Resuming at another world size
  is refused at the key that sets its length, unless both runs divide the same
  ``training.global_batch_size`` among their ranks (then an epoch takes the same updates);
- a stream saved mid-epoch holds its loader's state, which a loader with another number of
  workers cannot take up (torchdata's ``StatefulDataLoader`` fails with an AssertionError): a
  changed ``training.num_workers`` is refused, with both values.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from unison.checkpoint.entry import file_in
from unison.checkpoint.manifest import read_entries
from unison.checkpoint.retention import oldest_first
from unison.checkpoint.sharded_files import REST
from unison.recipe.planning.run_plan import RunPlan
from unison.recipe.planning.scheduler_resume import torch_scheduler

LENGTH_KEYS = ("total_steps", "epochs", "steps_per_epoch")
"""The keywords that set how many steps ``OneCycleLR`` takes."""


def saved_checkpoint(run_dir: Path, which: str) -> tuple[Path, Mapping[str, Any]] | None:
    """The checkpoint a resume of ``run_dir`` would load (``which``: ``"auto"``, the newest the
    manifest records, or a checkpoint's path) and its state, tensors mapped, not read; None when
    there is none or it cannot be read (the rank's own resume reports that)."""
    try:
        if which == "auto":
            folder = run_dir / "checkpoints"
            entries = oldest_first(read_entries(folder / "manifest.json"))
            found = [p for p in (file_in(folder, e.file) for e in entries) if p.exists()]
            if not found:
                return None
            path = found[-1]
        else:
            path = Path(which)
        file = path / REST if path.is_dir() else path
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # unreadable here: the resume on the ranks names the problem
        return None
    return (path, state) if isinstance(state, Mapping) else None


def check_resume_shape(plan: RunPlan, run_dir: Path, which: str, world_size: int) -> None:
    """Refuses, before any rank starts, a resume of ``run_dir`` at ``world_size`` ranks that its
    checkpoint cannot continue (see the module's docstring).

    Raises:
        ConfigError: at the key, with the saved and the new values and what to do.
    """
    found = saved_checkpoint(run_dir, which)
    if found is None:
        return
    path, state = found
    meta = state.get("meta") or {}
    refs = plan.refs
    saved = ((state.get("config") or {}).get("training")) or {}
    workers = plan.loaders.training.num_workers
    if meta.get("mid_epoch") and state.get("data") is not None and "num_workers" in saved:
        if saved["num_workers"] != workers:
            raise refs.error(
                "training.num_workers",
                f"{saved['num_workers']} -> {workers} on resume: {path} was saved mid-epoch (iteration "
                f"{meta.get('iteration')}) with the training stream's position as its loader's "
                f"{saved['num_workers']} worker(s) kept it, and a loader with another number of workers "
                f"cannot take it up. Resume with num_workers: {saved['num_workers']}, or change it once "
                "the run resumes from a checkpoint saved at an epoch's end",
            )
    saved_world = int(meta.get("world_size", world_size))
    scheduler = plan.resolved.scheduler_type
    if torch_scheduler(scheduler) != "OneCycleLR" or plan.trainer.scheduler_every != "update":
        return
    if saved_world == world_size or _same_updates(plan, saved):
        return
    given = plan.resolved.scheduler_kwargs
    key = next(
        (f"training.scheduler_kwargs.{k}" for k in LENGTH_KEYS if k in given), "training.scheduler_type"
    )
    end = (
        "run past its last step, and OneCycleLR fails mid-epoch"
        if world_size < saved_world
        else "end before its final annealing"
    )
    raise refs.error(
        key,
        f"OneCycleLR is stepped once per optimizer update (training.scheduler_every: update) and counts its "
        f"length in updates; {path} was saved at {saved_world} ranks and this run has {world_size}, where an "
        f"epoch takes another number of updates, so the schedule would {end}. Resume at {saved_world} ranks "
        f"(--nproc {saved_world}, or torchrun --nproc-per-node), or start a new run whose {key.split('.')[-1]} "
        f"counts the updates at {world_size} ranks (with training.global_batch_size, an epoch takes the same "
        "updates at every world size)",
    )


def _same_updates(plan: RunPlan, saved: Mapping[str, Any]) -> bool:
    """Whether the saved run and this one divide the same ``training.global_batch_size`` among their
    ranks: an epoch then takes the same updates at every world size (each rank's shard and batch
    shrink alike; the data cannot change on resume)."""
    total = saved.get("global_batch_size")
    return total is not None and plan.lr.fixed_global and plan.lr.global_batch == total
