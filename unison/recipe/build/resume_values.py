"""The optimizer's values on resume: what the config derives or the user changed wins over the checkpoint.

Loading a checkpoint puts the optimizer's saved groups back, learning rate included. The
rule of a resumed run: a value the config determines is compared between the config that
saved the checkpoint (stored in it) and this run's config, each as it was derived — the
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
from unison.config import to_plain
from unison.distributed import get_world_size
from unison.handlers.lr_scaling import rebase_lr, scale_lr
from unison.recipe.build.parts import RunParts
from unison.recipe.planning.lr_plan import default_lr, plan_of, sets_lr_itself
from unison.recipe.planning.resolved import Resolved
from unison.recipe.planning.run_plan import RunPlan
from unison.recipe.planning.scheduler_resume import RESCALED, apply_scheduler_changes, torch_scheduler
from unison.utils import get_logger

_log = get_logger("unison.recipe.run")


def _saved(path: Path) -> tuple[Mapping[str, Any] | None, int]:
    """The config stored in a checkpoint and the world size it was saved at (tensors are mapped, not read)."""
    file = path / REST if path.is_dir() else path
    state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    config = state.get("config")
    return (config if isinstance(config, Mapping) else None), int(state["meta"]["world_size"])


def _base_lr(training: Mapping[str, Any], resolved: Resolved, world_size: int) -> tuple[float | None, float]:
    """The learning rate a training section gives the optimizer at ``world_size`` ranks, and its scale."""
    kwargs = training.get("optimizer_kwargs") or {}
    lr = training.get("lr")
    if lr is None:
        lr = kwargs.get("lr", None if resolved.optimizer_args else default_lr(resolved.optimizer_type))
    plan = plan_of(training, world_size)
    scale = scale_lr(1.0, plan.rule, plan.global_batch, plan.reference_batch)
    return (float(lr) * scale if isinstance(lr, (int, float)) else None), scale


def apply_on_resume(plan: RunPlan, parts: RunParts, resumed: Path | None) -> Path | None:
    """After the checkpoint ``resumed`` loaded: applies the optimizer values this config derives or
    changed (see the module's docstring). Returns ``resumed``.

    Distributed:
        Every rank applies the same values (no collective); rank 0 logs them.
    """
    saved, saved_world = _saved(resumed) if resumed is not None else (None, 0)
    if saved is None or not isinstance(saved.get("training"), Mapping):
        return resumed
    resolved = plan.resolved
    old, new = saved["training"], to_plain(plan.config)["training"]
    world = get_world_size()
    (old_lr, old_scale), (new_lr, new_scale) = (
        _base_lr(old, resolved, saved_world),
        _base_lr(new, resolved, world),
    )
    if sets_lr_itself(resolved.scheduler_type):  # its own lr arguments, scaled
        old_lr, new_lr = _own_lr(old, resolved, old_scale), _own_lr(new, resolved, new_scale)
    optimizer = parts.optimizer
    if old_lr and new_lr is not None and not math.isclose(old_lr, new_lr, rel_tol=1e-12):
        before = optimizer.param_groups[0]["lr"]
        rebase_lr(optimizer, new_lr / old_lr, [parts.scheduler])
        _log.info(
            "learning rate on resume: %g -> %g (this config's base %g at %d ranks; the checkpoint's %g at %d ranks)",
            before, optimizer.param_groups[0]["lr"], new_lr, world, old_lr, saved_world,
        )  # fmt: skip
    old_kw, new_kw = old.get("optimizer_kwargs") or {}, new.get("optimizer_kwargs") or {}
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
        old_sk, new_sk = old.get("scheduler_kwargs") or {}, new.get("scheduler_kwargs") or {}
        apply_scheduler_changes(parts.scheduler, old_sk, new_sk, resolved.scheduler_type)
    return resumed


def _own_lr(training: Mapping[str, Any], resolved: Resolved, scale: float) -> float:
    """The rate of a scheduler that sets it itself, as a training section gives it: ``OneCycleLR``'s
    ``max_lr`` times the scale (every rate of its schedule moves with it); the scale alone for
    another (``CyclicLR``: a change of its rates is refused before the ranks start)."""
    own = RESCALED.get(torch_scheduler(resolved.scheduler_type) or "")
    value = (training.get("scheduler_kwargs") or {}).get(own) if own else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value) * scale
    return scale
