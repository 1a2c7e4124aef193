"""The optimizer's values on resume: what the config derives or the user changed wins over the checkpoint.

Loading a checkpoint puts the optimizer's saved groups back, learning rate included. The
rule of a resumed run: a value the config determines is compared between the config that
saved the checkpoint (stored in it) and this run's plan (``RunPlan.resume``), each as it was
derived by one rule (:mod:`unison.recipe.planning.resume_base`) — the
learning rate after ``training.lr`` and ``training.lr_scaling`` at that run's world size.
Where they agree, the checkpoint's value stays (it holds the schedule's progress); where
they differ, this run's value is applied after loading and logged:

- the learning rate moves by the ratio of the two bases, in every group and in the
  scheduler (``base_lrs``, ``initial_lr``, ``OneCycleLR``'s and ``CyclicLR``'s peaks), so the
  schedule continues from the new base where it had reached (a world-size change under
  ``lr_scaling``, a ``--set training.lr=``);
- any other optimizer keyword (``weight_decay``, ``momentum``, ``betas`` ...) that changed
  in ``training.optimizer_kwargs`` is set in every group;
- a changed ``training.scheduler_kwargs`` key is set on the loaded scheduler, or (``OneCycleLR``'s
  ``max_lr``) moves every rate with the learning rate; any other was refused before the ranks
  started (:mod:`unison.recipe.planning.scheduler_resume`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from unison.checkpoint.sharded_files import REST
from unison.handlers.lr_scaling import rebase_lr
from unison.recipe.build.parts import RunParts
from unison.recipe.planning.resume_base import resume_base
from unison.recipe.planning.run_plan import RunPlan
from unison.recipe.planning.scheduler_resume import apply_scheduler_changes
from unison.utils import get_logger

_log = get_logger("unison.recipe.run")


def _saved(path: Path) -> tuple[Mapping[str, Any] | None, int]:
    """The config stored in a checkpoint and the world size it was saved at (tensors are mapped, not read)."""
    file = path / REST if path.is_dir() else path
    state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    config = state.get("config")
    return (config if isinstance(config, Mapping) else None), int(state["meta"]["world_size"])


def apply_on_resume(plan: RunPlan, parts: RunParts, resumed: Path | None) -> Path | None:
    """After the checkpoint ``resumed`` loaded: applies the optimizer values this config derives or
    changed (see the module's docstring). Returns ``resumed``.

    Distributed:
        Every rank applies the same values (no collective); rank 0 logs them.
    """
    saved, saved_world = _saved(resumed) if resumed is not None else (None, 0)
    if saved is None or not isinstance(saved.get("training"), Mapping):
        return resumed
    resolved, new, world = plan.resolved, plan.resume, plan.world_size  # this run's: planned once
    old = resume_base(saved["training"], resolved, saved_world)  # the checkpoint's, by the same rule
    old_lr, new_lr = old.lr, new.lr
    optimizer = parts.optimizer
    if old_lr and new_lr is not None and not math.isclose(old_lr, new_lr, rel_tol=1e-12):
        before = optimizer.param_groups[0]["lr"]
        rebase_lr(optimizer, new_lr / old_lr, [parts.scheduler])
        _log.info(
            "learning rate on resume: %g -> %g (this config's base %g at %d ranks; the checkpoint's %g at %d ranks)",
            before, optimizer.param_groups[0]["lr"], new_lr, world, old_lr, saved_world,
        )  # fmt: skip
    old_kw, new_kw = old.optimizer_kwargs, new.optimizer_kwargs
    for key in sorted((old_kw.keys() | new_kw.keys()) - {"lr"}):
        if old_kw.get(key) == new_kw.get(key) or key not in resolved.optimizer_kwargs:
            continue  # unchanged, or left out now: the checkpoint's value stays
        value = resolved.optimizer_kwargs[key]
        for group in optimizer.param_groups:
            group[key] = (
                tuple(value) if isinstance(group.get(key), tuple) and isinstance(value, list) else value
            )
        _log.info("optimizer %s on resume: %r (changed from %r)", key, value, old_kw.get(key))
    if parts.scheduler is not None:  # training.scheduler_kwargs: set over the loaded state, where it can be
        apply_scheduler_changes(
            parts.scheduler, old.scheduler_kwargs, new.scheduler_kwargs, resolved.scheduler_type
        )
    return resumed
