"""What a resume compares with the checkpoint's: the values a training section gives the optimizer.

A resumed run keeps the checkpoint's optimizer values where the config that saved it and this
run's config derive the same ones, and applies this run's where they differ
(:mod:`unison.recipe.build.resume_values`). :func:`resume_base` derives them from a training
section as plain data, so one rule reads both sides: this run's, once, into the plan
(``RunPlan.resume``), and the checkpoint's stored section when it loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from unison.handlers.lr_scaling import scale_lr
from unison.recipe.planning.lr_plan import default_lr, plan_of, sets_lr_itself
from unison.recipe.planning.scheduler_resume import RESCALED, torch_scheduler


@dataclass(frozen=True)
class ResumeBase:
    """A training section's base learning rate at a world size (``training.lr`` and
    ``training.lr_scaling`` applied; a scheduler that sets its own rate: its peak, scaled), and
    its optimizer and scheduler keyword arguments as written."""

    lr: float | None
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    scheduler_kwargs: dict[str, Any] = field(default_factory=dict)


def resume_base(training: Mapping[str, Any], resolved: Any, world_size: int) -> ResumeBase:
    """The :class:`ResumeBase` of ``training`` (a section as plain data) at ``world_size`` ranks;
    ``resolved``: what the plan resolved (its optimizer's type and arguments, its scheduler's type)."""
    kwargs = dict(training.get("optimizer_kwargs") or {})
    lr = training.get("lr")
    if lr is None:
        lr = kwargs.get("lr", None if resolved.optimizer_args else default_lr(resolved.optimizer_type))
    plan = plan_of(training, world_size)
    scale = scale_lr(1.0, plan.rule, plan.global_batch, plan.reference_batch)
    base = float(lr) * scale if isinstance(lr, (int, float)) else None
    if sets_lr_itself(resolved.scheduler_type):  # its own lr arguments, scaled
        base = _own_lr(training, resolved, scale)
    return ResumeBase(base, kwargs, dict(training.get("scheduler_kwargs") or {}))


def _own_lr(training: Mapping[str, Any], resolved: Any, scale: float) -> float:
    """The rate of a scheduler that sets it itself, as a training section gives it: ``OneCycleLR``'s
    ``max_lr`` times the scale (every rate of its schedule moves with it); the scale alone for
    another (``CyclicLR``: a change of its rates is refused before the ranks start)."""
    own = RESCALED.get(torch_scheduler(resolved.scheduler_type) or "")
    value = (training.get("scheduler_kwargs") or {}).get(own) if own else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value) * scale
    return scale
