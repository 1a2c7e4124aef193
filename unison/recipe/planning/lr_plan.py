"""``training.lr_scaling`` in a run: the optimizer's learning rate scaled by the global batch, and warmup.

The global batch is ranks x ``training.batch_size`` x ``training.accumulation_steps``, or
``training.global_batch_size``, the same at every world size. The string form (``linear``,
``sqrt``) scales by it over one rank's batch (``batch_size x accumulation_steps``), which is the
world size: what it always meant (refused with a global batch size, which the world size does
not change). The mapping form names the reference (``reference_batch_size``, the global batch
the learning rate was tuned for; with a global batch size, that size by default, so the
learning rate is the one written) and a warmup over ``warmup_steps`` optimizer updates
(:class:`~unison.handlers.LRWarmup`: a factor inside ``optimizer.step()``, on top of any
scheduler). Rank 0 logs the learning rate the run uses, once, when the optimizer is built.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from unison.config import Config, to_plain
from unison.config.batch_sizes import DEFAULT_BATCH_SIZE
from unison.engine import Engine
from unison.handlers import LRWarmup, scale_lr
from unison.utils import get_logger

_log = get_logger("unison.recipe.run")


@dataclass(frozen=True)
class LRPlan:
    """How a run's learning rate is scaled and warmed up, at ``world_size`` ranks."""

    rule: str
    global_batch: int
    reference_batch: int
    warmup_steps: int
    world_size: int = 1
    batch_size: int = 1
    accumulation_steps: int = 1
    fixed_global: bool = False
    """Whether the global batch is ``training.global_batch_size``: the same at every world size."""

    def at(self, world_size: int) -> LRPlan:
        """The same plan at ``world_size`` ranks (the global batch grows with it, unless it is fixed:
        then each rank's batch shrinks).

        Example:
            >>> LRPlan("linear", 8, 8, 0, 1, 4, 2).at(3).global_batch
            24
            >>> LRPlan("none", 64, 64, 0, 1, 32, 2, fixed_global=True).at(4).batch_size
            8
        """
        if self.fixed_global:
            per_rank = max(1, self.global_batch // (world_size * self.accumulation_steps))
            return dataclasses.replace(self, world_size=world_size, batch_size=per_rank)
        one_rank = self.batch_size * self.accumulation_steps
        return dataclasses.replace(self, global_batch=world_size * one_rank, world_size=world_size)


def lr_plan(config: Config, world_size: int) -> LRPlan:
    """The scaling rule, the global and reference batches, and the warmup of ``config``."""
    return plan_of(to_plain(config.training), world_size)


def plan_of(training: Mapping[str, Any], world_size: int) -> LRPlan:
    """:func:`lr_plan` of a ``training`` section as plain data (what a checkpoint stores)."""
    accumulation, total = int(training.get("accumulation_steps", 1)), training.get("global_batch_size")
    if total is not None:  # the same at every world size; the learning rate was written for it
        batch = max(1, int(total) // (world_size * accumulation))
        one_rank, global_batch = int(total), int(total)
    else:
        batch = int(training.get("batch_size") or DEFAULT_BATCH_SIZE)
        one_rank = batch * accumulation
        global_batch = world_size * one_rank
    ls = training.get("lr_scaling", "none")
    if isinstance(ls, str):
        rule, reference, warmup = ls, one_rank, 0
    else:
        rule, reference = ls.get("rule", "none"), int(ls.get("reference_batch_size") or one_rank)
        warmup = int(ls.get("warmup_steps", 0))
    return LRPlan(
        rule, global_batch, reference, warmup, world_size, batch, accumulation, fixed_global=total is not None
    )


SETS_LR_ITSELF = {"OneCycleLR": ("max_lr",), "CyclicLR": ("base_lr", "max_lr")}
"""Schedulers that set the groups' learning rate from arguments of their own, which
``training.lr_scaling`` scales instead of the optimizer's ``lr``."""


def sets_lr_itself(scheduler_type: Any) -> bool:
    """Whether ``scheduler_type`` is (a subclass of) a scheduler of :data:`SETS_LR_ITSELF`."""
    names = {
        c.__name__ for c in getattr(scheduler_type, "__mro__", ()) if c.__module__.startswith("torch.optim")
    }
    return bool(names & SETS_LR_ITSELF.keys())


def scaled_scheduler_kwargs(plan: LRPlan, scheduler_type: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` of a scheduler that sets the learning rate itself (``OneCycleLR``'s ``max_lr``,
    ``CyclicLR``'s ``base_lr`` and ``max_lr``) scaled as ``plan`` (``training.lr_scaling`` at the
    run's world size) says; others as given."""
    if plan.rule == "none" or not sets_lr_itself(scheduler_type):
        return kwargs
    scale = scale_lr(1.0, plan.rule, plan.global_batch, plan.reference_batch)
    out = dict(kwargs)
    for c in scheduler_type.__mro__:
        for key in SETS_LR_ITSELF.get(c.__name__, ()):
            value = kwargs.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key] = value * scale
            elif isinstance(value, (list, tuple)):
                out[key] = type(value)(v * scale for v in value)
    _log.info(
        "%s sets the learning rate itself: %s scaled by %g (%s scaling by the global batch %d over %d)",
        scheduler_type.__name__, ", ".join(f"{k} {out[k]}" for k in out if out[k] is not kwargs[k]),
        scale, plan.rule, plan.global_batch, plan.reference_batch,
    )  # fmt: skip
    return out


def default_lr(optimizer_type: type) -> float | None:
    """The ``lr`` default of an optimizer class's signature, when it has a number there."""
    try:
        default = inspect.signature(optimizer_type).parameters["lr"].default
    except (KeyError, TypeError, ValueError):
        return None
    return float(default) if isinstance(default, (int, float)) and not isinstance(default, bool) else None


def scaled_optimizer_kwargs(
    plan: LRPlan, optimizer_type: type, kwargs: dict[str, Any], args: Sequence[Any] = ()
) -> dict[str, Any]:
    """``kwargs`` with ``lr`` scaled as ``plan`` (``training.lr_scaling`` at the run's world size)
    says; logs the plan on rank 0.

    Without ``lr`` in ``kwargs`` the optimizer's own default is scaled (when its signature
    has a number there, and no positional ``args`` could be giving it).
    """
    base = kwargs.get("lr", None if args else default_lr(optimizer_type))
    if base is None or isinstance(base, torch.Tensor) or (plan.rule == "none" and not plan.warmup_steps):
        return kwargs
    lr = scale_lr(float(base), plan.rule, plan.global_batch, plan.reference_batch)
    warmup = (
        f"; warmup over {plan.warmup_steps} optimizer updates, the first at {lr / plan.warmup_steps:g}"
        if plan.warmup_steps
        else ""
    )
    _log.info(
        "learning rate %g: lr %g, %s scaling by the global batch %d (%d ranks x %d x %d accumulation) over %d%s",
        lr,
        float(base),
        plan.rule,
        plan.global_batch,
        plan.world_size,
        plan.batch_size,
        plan.accumulation_steps,
        plan.reference_batch,
        warmup,
    )
    return {**kwargs, "lr": lr}


def attach_lr_warmup(plan: LRPlan, optimizer: torch.optim.Optimizer, trainer: Engine) -> LRWarmup | None:
    """Attaches the warmup of ``plan`` (``training.lr_scaling.warmup_steps``) to the trainer; None
    without one.

    Distributed:
        Every rank attaches it alike (no collective).
    """
    steps = plan.warmup_steps
    if not steps:
        return None
    warmup = LRWarmup(optimizer, steps)
    warmup.attach(trainer)
    return warmup
