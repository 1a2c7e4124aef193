"""``training.lr_scaling`` in a run: the optimizer's learning rate scaled by the global batch, and warmup.

The global batch is ranks x ``training.batch_size`` x ``training.accumulation_steps``. The
string form (``linear``, ``sqrt``) scales by it over one rank's batch (``batch_size x
accumulation_steps``), which is the world size: what it always meant. The mapping form
names the reference (``reference_batch_size``, the global batch the learning rate was
tuned for) and a warmup over ``warmup_steps`` optimizer updates
(:class:`~unison.handlers.LRWarmup`: a factor inside ``optimizer.step()``, on top of any
scheduler). Rank 0 logs the learning rate the run uses, once, when the optimizer is built.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from unison.config import Config
from unison.engine import Engine
from unison.handlers import LRWarmup, scale_lr
from unison.utils import get_logger

_log = get_logger("unison.cli.run")


@dataclass(frozen=True)
class LRPlan:
    """How a run's learning rate is scaled and warmed up."""

    rule: str
    global_batch: int
    reference_batch: int
    warmup_steps: int


def lr_plan(config: Config, world_size: int) -> LRPlan:
    """The scaling rule, the global and reference batches, and the warmup of ``config``."""
    t = config.training
    one_rank = t.batch_size * t.accumulation_steps
    if isinstance(t.lr_scaling, str):
        return LRPlan(t.lr_scaling, world_size * one_rank, one_rank, 0)
    ls = t.lr_scaling
    return LRPlan(ls.rule, world_size * one_rank, ls.reference_batch_size or one_rank, ls.warmup_steps)


def _default_lr(optimizer_type: type) -> float | None:
    """The ``lr`` default of an optimizer class's signature, when it has a number there."""
    try:
        default = inspect.signature(optimizer_type).parameters["lr"].default
    except (KeyError, TypeError, ValueError):
        return None
    return float(default) if isinstance(default, (int, float)) and not isinstance(default, bool) else None


def scaled_optimizer_kwargs(
    config: Config, optimizer_type: type, kwargs: dict[str, Any], world_size: int, args: Sequence[Any] = ()
) -> dict[str, Any]:
    """``kwargs`` with ``lr`` scaled as ``training.lr_scaling`` says; logs the plan on rank 0.

    Without ``lr`` in ``kwargs`` the optimizer's own default is scaled (when its signature
    has a number there, and no positional ``args`` could be giving it).
    """
    plan = lr_plan(config, world_size)
    base = kwargs.get("lr", None if args else _default_lr(optimizer_type))
    if base is None or isinstance(base, torch.Tensor) or (plan.rule == "none" and not plan.warmup_steps):
        return kwargs
    lr = scale_lr(float(base), plan.rule, plan.global_batch, plan.reference_batch)
    t = config.training
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
        world_size,
        t.batch_size,
        t.accumulation_steps,
        plan.reference_batch,
        warmup,
    )
    return {**kwargs, "lr": lr}


def attach_lr_warmup(config: Config, optimizer: torch.optim.Optimizer, trainer: Engine) -> LRWarmup | None:
    """Attaches the warmup of ``training.lr_scaling.warmup_steps`` to the trainer; None without one.

    Distributed:
        Every rank attaches it alike (no collective).
    """
    steps = lr_plan(config, 1).warmup_steps
    if not steps:
        return None
    warmup = LRWarmup(optimizer, steps)
    warmup.attach(trainer)
    return warmup
